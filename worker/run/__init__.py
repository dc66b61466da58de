"""The worker process: one engine loaded once, the Celery tasks that feed it, the heartbeat that
keeps leases, the reaper that heals the queue, the local worker `specbatch run` starts, exit codes,
metrics and the noise it silences."""
