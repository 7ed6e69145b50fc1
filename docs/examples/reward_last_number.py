"""An example reward for `reward: {type: python, function: "docs/examples/reward_last_number.py:score"}`.

fp8rl calls ``score(response, answer, example)`` for every sampled response: ``answer`` is the record's
normalised reference answer, ``example`` the record (its ``prompt``, ``answer``, ``messages`` and any
other fields). Return a float; an exception or a call slower than ``reward.timeout_s`` scores 0 and is
counted in ``reward/errors`` / ``reward/timeouts``.
"""

from fp8rl.tasks.rewards import extract_last_number


def score(response: str, answer: str, example: dict) -> float:
    correct = extract_last_number(response) == answer
    # a small bonus for a short answer; records may carry their own weight, e.g. {"weight": 2.0}
    brevity = 0.1 if len(response) <= 16 else 0.0
    return float(example.get("weight", 1.0)) * (float(correct) + brevity * float(correct))
