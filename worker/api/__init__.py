"""What users touch: the producer API (`Client`), the `specbatch` command, and what it prints
(status, a job's view, run summaries, the HTML report, Flower)."""
