"""Seeded benchmark workloads shared by the benchmarks (chat prompts with long-tailed lengths)."""

from __future__ import annotations

import numpy as np

TOPICS = [
    "the water cycle", "black holes", "the French revolution", "how vaccines work", "compound interest",
    "photosynthesis", "the history of the internet", "machine learning", "volcanoes", "the Roman empire",
    "climate change", "how airplanes fly", "the human heart", "electric cars", "coffee", "honey bees",
    "the moon landing", "quantum computing", "jazz music", "the Great Wall of China", "recycling",
    "earthquakes", "the stock market", "DNA", "rainbows", "the printing press", "sleep", "chess",
    "the Olympic games", "solar panels", "octopuses", "the Renaissance",
]
TASKS = [
    "Explain {t} to a ten-year-old.", "Write a short essay about {t}.", "Give me five facts about {t}.",
    "Write a poem about {t}.", "What are the pros and cons of {t}?", "Summarize the key ideas of {t}.",
    "Tell me a story that involves {t}.", "Describe {t} in detail.",
]


def long_tail_workload(num: int, seed: int = 0, median: int = 64, lo: int = 16, hi: int = 512):
    """``num`` chat conversations and their ``max_tokens``: lognormal, median ``median``, clipped."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(mean=np.log(median), sigma=0.9, size=num)), lo, hi).astype(int)
    convs = []
    for i in range(num):
        task = TASKS[rng.integers(len(TASKS))].format(t=TOPICS[rng.integers(len(TOPICS))])
        convs.append([{"role": "user", "content": task}])
    return convs, [int(x) for x in lengths]
