"""Seeded workloads for the speculation benchmark: input-grounded prompts (answers copy the input)
and structured extraction requests (outputs share one JSON shape)."""

from __future__ import annotations

import numpy as np

REWRITE_TEXT = (
    "The committee met on tuesday to review the anual budget. After a long discusion, the members agreed to "
    "increase funding for the public library by ten percent, to repair the roads in the northern district, and to "
    "postpone the decision on the new sports center until the spring meeting. The chair thanked the volunteers "
    "who organised the town fair and reminded everyone that the next meeting will be held on the first monday of "
    "march in the main hall of the city building."
)
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return total


def cheapest_item(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
NOTES = (
    "Meeting notes, project Atlas. Attendees: Maria Lopez (design), Tom Becker (backend), Ana Silva (QA), "
    "James Okafor (product). Decisions: the release moves to June 14; the payment page keeps the old layout; "
    "Tom owns the database migration; Ana writes the regression plan for the checkout flow. Open questions: "
    "whether the mobile app ships with the web release, and who reviews the accessibility audit."
)
GROUNDED = [
    "Rewrite the following text, fixing the spelling and capitalisation mistakes and changing nothing else:\n\n"
    + REWRITE_TEXT,
    "Rename the variable `total` to `amount` everywhere in this Python code and return the full code:\n\n" + CODE,
    "Copy every sentence of these notes that mentions a person, word for word, one per line:\n\n" + NOTES,
    "Summarize the following text by repeating its first two sentences verbatim:\n\n" + REWRITE_TEXT,
]

NAMES = ["Alice Martin", "Bruno Costa", "Chen Wei", "Dana Cohen", "Emeka Obi", "Fatima Zahra", "Greta Lind",
         "Hiro Tanaka", "Ines Duarte", "Jonas Berg", "Kira Novak", "Luis Ortega", "Maya Patel", "Noah Schmidt"]
CITIES = ["Lisbon", "Toronto", "Osaka", "Nairobi", "Berlin", "Lima", "Oslo", "Madrid", "Seoul", "Dublin"]
JOBS = ["nurse", "teacher", "software engineer", "chef", "architect", "pilot", "farmer", "journalist"]
HOBBIES = ["chess", "hiking", "painting", "cycling", "baking", "photography", "gardening", "swimming"]


def extraction_workload(num: int, seed: int = 0) -> list[str]:
    """``num`` requests to turn a short bio into a JSON record with the same five keys."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(num):
        name, city = NAMES[rng.integers(len(NAMES))], CITIES[rng.integers(len(CITIES))]
        job, hobby, age = JOBS[rng.integers(len(JOBS))], HOBBIES[rng.integers(len(HOBBIES))], int(rng.integers(21, 70))
        bio = f"{name} is a {age}-year-old {job} who lives in {city}. In the evenings {name.split()[0]} enjoys {hobby}."
        prompts.append(
            'Extract a JSON object with the keys "name", "age", "city", "occupation" and "hobby" from this text. '
            f"Answer with the JSON only.\n\nText: {bio}"
        )
    return prompts
