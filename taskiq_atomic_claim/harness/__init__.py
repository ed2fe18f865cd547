"""What tests and drills run: throwaway local servers, real ``taskiq
worker`` processes and the app they load. Neither a worker nor the operator
CLI needs it (the CLI's ``drill`` command imports it when run)."""
