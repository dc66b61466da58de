"""The SQL store, the one source of truth for jobs: tables, migrations, idempotent writes,
claims fenced by attempt, group commit of many threads' writes, and retries through an outage."""
