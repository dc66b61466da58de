"""specbatch's queue side: requests, ingest, the Redis queue, the SQL store, the worker process
and the user-facing commands. It knows nothing of attention: it hands requests to `engine`."""
