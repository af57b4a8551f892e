"""A varied, offline set of chat requests whose answers make the general-text store.

A chat answer is drafted best from text that reads like a chat answer, and the text that
reads most like this model's answers is its own answers to other requests.  No chat
corpus can be downloaded offline, so the set is written here: everyday requests of eight
kinds (writing, role play, reasoning, maths, coding, extraction, science and technology,
humanities), each a template filled with topics, so a few hundred distinct requests come
from a few dozen lines.  None of them is a prompt of the benchmark's chat suite: the store
must help with questions it has never seen.

`answer_prompts()` is deterministic: the same list, in the same order, on every machine.
"""
from __future__ import annotations

import random

TOPICS = (
    "volcanoes", "the water cycle", "black holes", "the human heart", "electric cars", "solar panels",
    "the Roman Empire", "the printing press", "honey bees", "climate change", "the stock market", "inflation",
    "machine learning", "the internet", "antibiotics", "sleep", "meditation", "coffee", "chess", "jazz music",
    "the Renaissance", "the French Revolution", "ancient Egypt", "the moon landing", "earthquakes", "rainforests",
    "recycling", "public libraries", "remote work", "social media", "time management", "learning a new language",
    "the immune system", "DNA", "gravity", "electricity", "the periodic table", "democracy", "world trade",
    "urban gardening", "marathon training", "healthy breakfasts", "budget travel", "photography", "volunteering",
    "video games", "the Olympic Games", "penguins", "coral reefs", "the speed of light",
)

TOPIC_TASKS = (
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Give me five interesting facts about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Write the opening paragraph of a blog post about {t}.",
    "What are three common misconceptions about {t}?",
    "Describe {t} to someone who has never heard of it.",
    "Why is {t} important? Answer in a few sentences.",
)

WRITING = (
    "Write a short email to a colleague asking to move our meeting to Thursday.",
    "Write a thank-you note to a neighbour who watered my plants.",
    "Write a polite complaint to a hotel about a noisy room.",
    "Write a short cover letter for a junior web developer position.",
    "Write an invitation to a small dinner party on Saturday evening.",
    "Write a short speech for a friend's wedding.",
    "Write a motivational message for a team before a big deadline.",
    "Write a product review of a pair of running shoes.",
    "Write a short story about a robot who learns to paint.",
    "Write a poem about the first day of spring.",
    "Write a limerick about a cat who loves the rain.",
    "Write an apology email for missing a deadline.",
    "Write a short announcement that the office will be closed on Monday.",
    "Write a LinkedIn post about finishing an online course.",
    "Write a text message reminding a friend about our lunch tomorrow.",
    "Write a two-paragraph description of a cosy mountain cabin for a rental website.",
    "Write a letter to my future self ten years from now.",
    "Write a short persuasive paragraph on why cities should plant more trees.",
    "Write a farewell message for a coworker who is retiring.",
    "Write a short mystery story set on a train.",
)

ROLES = (
    ("a pirate captain", "describe your ship"), ("a medieval knight", "explain your daily routine"),
    ("a travel guide in Rome", "suggest what to see in one day"), ("a fitness coach", "give me a weekly plan"),
    ("a friendly librarian", "recommend three classic novels"), ("a chef", "explain how to make a simple omelette"),
    ("an astronaut on the space station", "describe what you see from the window"),
    ("a detective", "explain how you solve a case"), ("a museum guide", "introduce the dinosaur hall"),
    ("a customer service agent", "help me return a broken kettle"),
    ("Sherlock Holmes", "tell me what you deduce about a muddy pair of boots"),
    ("a kind teacher", "encourage a student who failed a test"),
    ("a job interviewer", "ask me three questions for a sales role"),
    ("a park ranger", "explain how to stay safe around bears"),
    ("a barista", "explain the difference between a latte and a cappuccino"),
    ("a tech support agent", "help me reset my home router"),
)

CODING = (
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python function that finds the largest number in a list without using max().",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Write a Python function that reads a text file and returns the ten most common words.",
    "Explain the difference between a for loop and a while loop in Python.",
    "How do I sort a list of dictionaries by a key in Python?",
    "What is a Python decorator? Give an example.",
    "Explain what a REST API is, with an example request.",
    "Write a SQL query that returns the five customers with the highest total orders.",
    "Write a JavaScript function that capitalizes the first letter of every word.",
    "How do I handle exceptions in Python? Show an example.",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    "Explain the difference between a stack and a queue.",
    "Write a Python function that converts Celsius to Fahrenheit and back.",
    "What does the Python keyword yield do?",
    "Write a Python script that prints the multiplication table from 1 to 10.",
    "How do I create a virtual environment in Python?",
    "Explain Big O notation with two examples.",
    "Write a Python function that flattens a nested list.",
    "What is the difference between == and is in Python?",
)

NAMES = ("Anna", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Isabel", "Jonas", "Kofi", "Lena")
CITIES = ("Lisbon", "Oslo", "Nairobi", "Toronto", "Kyoto", "Lima", "Prague", "Dublin", "Seoul", "Cairo")
ITEMS = ("apples", "notebooks", "pencils", "oranges", "tickets", "cupcakes", "books", "bottles of water")


def _maths(rng: random.Random) -> list[str]:
    out = []
    for _ in range(24):
        a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(2, 9)
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        out.append(rng.choice((
            f"{name} buys {a} {item} at {b} dollars each and pays with a {a * b + c * 5} dollar note. "
            f"How much change does {name} get?",
            f"A train travels {a * 10} kilometres in {c} hours. What is its average speed?",
            f"What is {a} percent of {b * 50}?",
            f"Solve for x: {c}x + {a} = {c * b + a}.",
            f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
            f"If {c} workers build a wall in {b} days, how long would {c * 2} workers take?",
            f"{name} has {a} {item} and gives away one third of them, rounded down. How many are left?",
        )))
    return out


def _reasoning(rng: random.Random) -> list[str]:
    out = []
    for _ in range(16):
        p, q, r = rng.sample(NAMES, 3)
        out.append(rng.choice((
            f"{p} is taller than {q}, and {q} is taller than {r}. Who is the shortest? Explain.",
            f"{p}, {q} and {r} each have a different pet: a cat, a dog and a fish. {p} does not have the cat and "
            f"{q} has the fish. Who has which pet?",
            "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
            f"{p} was born before {q}, and {r} was born after {q}. Who is the oldest?",
            "A farmer has 17 sheep and all but 9 run away. How many are left? Explain your reasoning.",
            "What comes next in the sequence 2, 6, 12, 20, 30? Explain the pattern.",
        )))
    return out


def _extraction(rng: random.Random) -> list[str]:
    out = []
    for _ in range(16):
        p, q = rng.sample(NAMES, 2)
        c1, c2 = rng.sample(CITIES, 2)
        day, price = rng.randint(1, 28), rng.randint(20, 400)
        text = (f"{p} flew from {c1} to {c2} on March {day} to meet {q}. The ticket cost {price} euros, and the "
                f"meeting about the new library project lasted three hours.")
        out.append(rng.choice((
            f"Extract every person, city and date from this text as a JSON object:\n\n{text}",
            f"List the names mentioned in this text, one per line:\n\n{text}",
            f"From the text below, how much did the ticket cost and who paid for it?\n\n{text}",
            f"Turn this sentence into a table with the columns who, where, when:\n\n{text}",
        )))
    return out


def answer_prompts() -> list[str]:
    """The requests, in a fixed order (topics x tasks, then the fixed lists, then the numbered ones)."""
    rng = random.Random(20240611)
    out = [task.format(t=topic) for topic in TOPICS for task in TOPIC_TASKS]
    out += list(WRITING)
    out += [f"Pretend you are {who}. Please {what}." for who, what in ROLES]
    out += list(CODING)
    out += _maths(rng) + _reasoning(rng) + _extraction(rng)
    return list(dict.fromkeys(out))  # duplicates (a template drawn twice) once
