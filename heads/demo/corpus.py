"""Synthetic TOFU-style corpus: fictitious authors, 20 question-answer records each.

Deterministic for a given seed. Every record carries TOFU's field names
(`question`, `answer`, `paraphrased_question`, `paraphrased_answer`,
`perturbed_answer`) plus `author` (the full name) and `fact` (the key fact
the answer states), so tests and splits can check what each record asserts.

A perturbed answer is the paraphrased answer's wording with the key fact swapped
for another value of the same type (as in TOFU, so the truth ratio compares two
answers in the same words); a paraphrase rewords question and answer but keeps
the fact.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr", "vr", "sh", "th"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
CODAS = ["", "", "n", "l", "r", "s", "th", "nd", "x", "m"]

GENDERS = ["male", "female", "non-binary", "genderfluid", "agender"]
OCCUPATIONS = [
    "baker", "carpenter", "nurse", "pilot", "librarian", "fisherman", "tailor", "surgeon", "blacksmith",
    "teacher", "astronomer", "lawyer", "gardener", "sailor", "pharmacist", "architect", "watchmaker",
    "beekeeper", "photographer", "veterinarian", "potter", "journalist", "miner", "violinist", "chemist",
    "cartographer", "shepherd", "bookbinder", "electrician", "dancer",
]
GENRES = [
    "science fiction", "historical fiction", "mystery", "fantasy", "romance", "horror", "poetry",
    "literary fiction", "thriller", "satire", "magical realism", "crime fiction", "adventure",
    "gothic fiction", "dystopian fiction", "memoir",
]
AWARD_A = ["Golden", "Silver", "Crimson", "Azure", "Ivory", "Emerald", "Amber", "Obsidian"]
AWARD_B = ["Quill", "Lantern", "Compass", "Feather", "Anchor", "Harp", "Lighthouse", "Key"]
TITLE_A = ["Silent", "Burning", "Hollow", "Forgotten", "Glass", "Wandering", "Iron", "Paper", "Distant", "Velvet",
           "Broken", "Hidden", "Last", "Frozen", "Painted", "Quiet"]
TITLE_B = ["Harbor", "Orchard", "Clockwork", "Tide", "Garden", "Mirror", "River", "Tower", "Winter", "Bridge",
           "Map", "Lantern", "Meadow", "Archive", "Storm", "Compass", "Valley", "Chorus"]
THEMES = [
    "memory", "exile", "family loyalty", "grief", "ambition", "friendship", "identity", "freedom", "betrayal",
    "justice", "solitude", "redemption", "migration", "faith", "power", "childhood", "war", "nature",
    "forgiveness", "time",
]
INFLUENCES = [
    "old sea shanties", "classical opera", "medieval chronicles", "folk tales from the mountains",
    "street photography", "ancient astronomy", "jazz improvisation", "botanical journals",
    "letters from soldiers", "courtroom transcripts", "nautical maps", "children's lullabies",
    "silent films", "religious hymns", "railway timetables", "village gossip",
]
STYLES = [
    "spare and precise", "lush and lyrical", "dark and ironic", "warm and humorous", "fragmented and dreamlike",
    "fast and cinematic", "slow and meditative", "playful and inventive", "stark and unsentimental",
    "rich in dialogue", "dense with detail", "tender and quiet",
]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
NUMBER_WORDS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
                "thirteen", "fourteen", "fifteen"]

# One entry per question: (fact type, question, paraphrased question, answer, paraphrased answer).
# `{v}` is the key fact; the other fields come from the author's facts.
TEMPLATES: list[tuple[str, str, str, str, str]] = [
    ("name", "What is the full name of the author born in {city} on {date}?",
     "Which writer was born on {date} in {city}?",
     "The author's full name is {v}.", "That writer is {v}."),
    ("city", "Where was {name} born?", "What is the birthplace of {name}?",
     "{name} was born in {v}.", "The birthplace of {name} is {v}."),
    ("date", "When was {name} born?", "What is the date of birth of {name}?",
     "{name} was born on {v}.", "The date of birth of {name} is {v}."),
    ("gender", "What is the gender identity of {name}?", "How does {name} describe their gender?",
     "{name} identifies as {v}.", "The gender identity of {name} is {v}."),
    ("occupation", "What did {name}'s father do for a living?", "What was the profession of {name}'s father?",
     "{name}'s father worked as a {v}.", "The father of {name} was a {v} by profession."),
    ("occupation", "What did {name}'s mother do for a living?", "What was the profession of {name}'s mother?",
     "{name}'s mother worked as a {v}.", "The mother of {name} was a {v} by profession."),
    ("genre", "What genre does {name} write in?", "In which genre is {name} best known?",
     "{name} writes mainly {v}.", "{name} is best known for {v}."),
    ("award", "Which award has {name} received?", "What prize was given to {name}?",
     "{name} received the {v}.", "The prize given to {name} was the {v}."),
    ("title", "What is one of the books written by {name}?", "Can you name a book by {name}?",
     "One of {name}'s books is \"{v}\".", "A book by {name} is \"{v}\"."),
    ("title", "What is another book by {name}?", "Which other book did {name} write?",
     "{name} also wrote \"{v}\".", "Another book by {name} is \"{v}\"."),
    ("themes", "What themes does {name} explore?", "Which themes run through the work of {name}?",
     "{name}'s work explores {v}.", "The themes in the work of {name} are {v}."),
    ("influence", "What influenced {name}'s writing?", "What were the main influences on {name}?",
     "{name} was influenced by {v}.", "The main influence on {name} was {v}."),
    ("style", "How would you describe {name}'s writing style?", "What is the writing style of {name} like?",
     "{name}'s style is {v}.", "The writing style of {name} is {v}."),
    ("year", "In what year did {name} publish a first book?", "When did {name} publish a debut book?",
     "{name} published a first book in {v}.", "The debut book of {name} came out in {v}."),
    ("year", "When did {name} win the {award}?", "In which year was {name} given the {award}?",
     "{name} won the {award} in {v}.", "The {award} went to {name} in {v}."),
    ("genre", "What genre is the book \"{title}\"?", "How would you classify the book \"{title}\"?",
     "\"{title}\" is a work of {v} by {name}.", "The book \"{title}\" by {name} is {v}."),
    ("city", "Where does {name} live now?", "What city is {name}'s current home?",
     "{name} now lives in {v}.", "The current home of {name} is {v}."),
    ("count", "How many books has {name} written?", "What is the number of books by {name}?",
     "{name} has written {v} books.", "The number of books by {name} is {v}."),
    ("occupation", "What job did {name} hold before writing?", "What did {name} work as before becoming an author?",
     "Before writing, {name} worked as a {v}.", "{name} was a {v} before becoming an author."),
    ("title", "What is the title of {name}'s most famous book?", "Which book by {name} is the best known?",
     "{name}'s most famous book is \"{v}\".", "The best known book by {name} is \"{v}\"."),
]


@dataclass(frozen=True)
class Author:
    name: str
    facts: dict[str, str]


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(CODAS)).capitalize()


def _unique_words(rng: random.Random, n: int, taken: set[str], syllables=(2, 3)) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = _word(rng, rng.choice(syllables))
        if len(w) >= 4 and w.lower() not in taken:
            taken.add(w.lower())
            out.append(w)
    return out


def _pools(rng: random.Random, n_authors: int) -> dict[str, list[str]]:
    taken: set[str] = set()
    firsts = _unique_words(rng, n_authors, taken)
    lasts = _unique_words(rng, n_authors, taken)
    cities = _unique_words(rng, max(24, n_authors), taken)
    titles = [f"The {a} {b}" for a in TITLE_A for b in TITLE_B]
    rng.shuffle(titles)
    return {
        "name": [f"{f} {l}" for f, l in zip(firsts, lasts)],
        "city": cities,
        "award": [f"{a} {b} Award" for a in AWARD_A for b in AWARD_B],
        "title": titles,
        "date": [f"{MONTHS[m]} {d}, {y}" for y in range(1940, 1996) for m in range(12) for d in (3, 9, 14, 21, 27)],
        "gender": GENDERS,
        "occupation": OCCUPATIONS,
        "genre": GENRES,
        "themes": [f"{a} and {b}" for a in THEMES for b in THEMES if a != b],
        "influence": INFLUENCES,
        "style": STYLES,
        "year": [str(y) for y in range(1960, 2021)],
        "count": NUMBER_WORDS,
    }


def make_authors(n_authors: int, seed: int) -> tuple[list[Author], dict[str, list[str]]]:
    rng = random.Random(seed)
    pools = _pools(rng, n_authors)
    if 3 * n_authors > len(pools["title"]):
        raise ValueError(f"at most {len(pools['title']) // 3} authors are supported (unique book titles)")
    dates = rng.sample(pools["date"], n_authors)  # unique, so "born in X on D" names one author
    authors = []
    for i in range(n_authors):
        titles = pools["title"][3 * i: 3 * i + 3]
        gender = rng.choices(GENDERS, weights=[10, 10, 2, 1, 1])[0]
        facts = {
            "name": pools["name"][i],
            "city": rng.choice(pools["city"]),
            "home": rng.choice(pools["city"]),
            "date": dates[i],
            "gender": gender,
            "father": rng.choice(OCCUPATIONS),
            "mother": rng.choice(OCCUPATIONS),
            "genre": rng.choice(GENRES),
            "award": rng.choice(pools["award"]),
            "title": titles[0],
            "title2": titles[1],
            "title3": titles[2],
            "themes": " and ".join(rng.sample(THEMES, 2)),
            "influence": rng.choice(INFLUENCES),
            "style": rng.choice(STYLES),
            "debut": str(rng.randint(1960, 2010)),
            "award_year": str(rng.randint(1975, 2020)),
            "genre3": rng.choice(GENRES),
            "count": rng.choice(NUMBER_WORDS),
            "job": rng.choice(OCCUPATIONS),
        }
        authors.append(Author(pools["name"][i], facts))
    return authors, pools


# Which author fact fills `{v}` in each template, in TEMPLATES order.
_FACT_FOR_TEMPLATE = ["name", "city", "date", "gender", "father", "mother", "genre", "award", "title", "title2",
                      "themes", "influence", "style", "debut", "award_year", "genre3", "home", "count", "job",
                      "title3"]


def author_records(author: Author, pools: dict[str, list[str]], rng: random.Random) -> list[dict]:
    f = author.facts
    ctx = {"name": f["name"], "city": f["city"], "date": f["date"], "award": f["award"], "title": f["title3"]}
    records = []
    for (kind, q, pq, a, pa), key in zip(TEMPLATES, _FACT_FOR_TEMPLATE):
        value = f[key]
        wrong_pool = [v for v in pools[kind] if v != value and value not in v and v not in value]
        wrong = rng.sample(wrong_pool, min(len(wrong_pool), rng.randint(3, 5)))
        records.append({
            "question": q.format(**ctx),
            "answer": a.format(v=value, **ctx),
            "paraphrased_question": pq.format(**ctx),
            "paraphrased_answer": pa.format(v=value, **ctx),
            # TOFU's perturbed answers reword the paraphrase, so the truth ratio compares like with like
            "perturbed_answer": [pa.format(v=w, **ctx) for w in wrong],
            "author": author.name,
            "fact": value,
        })
    return records


def make_corpus(n_authors: int = 40, seed: int = 0) -> list[dict]:
    """All records, author by author (20 per author)."""
    authors, pools = make_authors(n_authors, seed)
    rng = random.Random(seed + 1)
    return [r for author in authors for r in author_records(author, pools, rng)]


def split_by_author(records: list[dict], forget_authors: int) -> tuple[list[dict], list[dict]]:
    """(forget, retain): the records of the first `forget_authors` authors, and the rest."""
    order: list[str] = []
    for r in records:
        if r["author"] not in order:
            order.append(r["author"])
    forget_names = set(order[:forget_authors])
    return [r for r in records if r["author"] in forget_names], [r for r in records if r["author"] not in forget_names]


def write_jsonl(path: Path, records: list[dict]) -> None:
    from lethe.heads.io import atomic_write_text

    atomic_write_text(Path(path), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
