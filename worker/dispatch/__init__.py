"""Redis and Celery: the app, task messages and their publisher, the pacer that releases batches
a window at a time, priority lanes and the governor that keeps task threads for them, the
embedded Redis, and kombu's repairs for living through a Redis restart."""
