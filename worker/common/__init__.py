"""What every part of the queue side shares: its settings (`config`), the periodic thread that
pacer, reaper and heartbeat run on, and the third-party noise silenced at its source."""
