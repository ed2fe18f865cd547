"""What an operator runs against a server: inspection, health checks and
their fixes, the ACL a worker needs, dead-letter listing and requeue.

Data and decisions only: nothing here parses arguments or prints; the CLI
(``taskiq_atomic_claim.cli``) renders it. No worker imports this package.
"""
