"""Facts a pretrained model knows, as question/answer records built from templates: the real-model benchmark's data.

Each kind of fact has a question template, paraphrases of it, and an answer template. The benchmark keeps only
the items the base model answers correctly (greedy, through its chat template) and splits them by kind into a
forget topic and retain topics. Not TOFU's real-authors or world-facts sets: those stay held out.
"""

from __future__ import annotations

from dataclasses import dataclass

COUNTRIES = {  # country: (capital, currency, continent)
    "France": ("Paris", "euro", "Europe"), "Germany": ("Berlin", "euro", "Europe"),
    "Italy": ("Rome", "euro", "Europe"), "Spain": ("Madrid", "euro", "Europe"),
    "Portugal": ("Lisbon", "euro", "Europe"), "Greece": ("Athens", "euro", "Europe"),
    "Austria": ("Vienna", "euro", "Europe"), "Ireland": ("Dublin", "euro", "Europe"),
    "Netherlands": ("Amsterdam", "euro", "Europe"), "Belgium": ("Brussels", "euro", "Europe"),
    "Norway": ("Oslo", "krone", "Europe"), "Sweden": ("Stockholm", "krona", "Europe"),
    "Denmark": ("Copenhagen", "krone", "Europe"), "Finland": ("Helsinki", "euro", "Europe"),
    "Poland": ("Warsaw", "zloty", "Europe"), "Hungary": ("Budapest", "forint", "Europe"),
    "Russia": ("Moscow", "ruble", "Europe"), "United Kingdom": ("London", "pound", "Europe"),
    "Switzerland": ("Bern", "franc", "Europe"), "Czech Republic": ("Prague", "koruna", "Europe"),
    "Japan": ("Tokyo", "yen", "Asia"), "China": ("Beijing", "yuan", "Asia"), "India": ("New Delhi", "rupee", "Asia"),
    "South Korea": ("Seoul", "won", "Asia"), "Thailand": ("Bangkok", "baht", "Asia"),
    "Vietnam": ("Hanoi", "dong", "Asia"), "Indonesia": ("Jakarta", "rupiah", "Asia"),
    "Philippines": ("Manila", "peso", "Asia"), "Turkey": ("Ankara", "lira", "Asia"),
    "Iran": ("Tehran", "rial", "Asia"), "Egypt": ("Cairo", "pound", "Africa"),
    "Kenya": ("Nairobi", "shilling", "Africa"), "Nigeria": ("Abuja", "naira", "Africa"),
    "Morocco": ("Rabat", "dirham", "Africa"), "South Africa": ("Pretoria", "rand", "Africa"),
    "Canada": ("Ottawa", "dollar", "North America"), "Mexico": ("Mexico City", "peso", "North America"),
    "United States": ("Washington", "dollar", "North America"), "Cuba": ("Havana", "peso", "North America"),
    "Brazil": ("Brasilia", "real", "South America"), "Argentina": ("Buenos Aires", "peso", "South America"),
    "Peru": ("Lima", "sol", "South America"), "Chile": ("Santiago", "peso", "South America"),
    "Colombia": ("Bogota", "peso", "South America"), "Australia": ("Canberra", "dollar", "Oceania"),
    "New Zealand": ("Wellington", "dollar", "Oceania"),
}

ELEMENTS = {"hydrogen": "H", "helium": "He", "carbon": "C", "nitrogen": "N", "oxygen": "O", "sodium": "Na",
            "magnesium": "Mg", "aluminium": "Al", "silicon": "Si", "phosphorus": "P", "sulfur": "S",
            "chlorine": "Cl", "potassium": "K", "calcium": "Ca", "iron": "Fe", "copper": "Cu", "zinc": "Zn",
            "silver": "Ag", "tin": "Sn", "iodine": "I", "gold": "Au", "mercury": "Hg", "lead": "Pb",
            "uranium": "U", "neon": "Ne", "argon": "Ar", "nickel": "Ni", "platinum": "Pt", "lithium": "Li",
            "fluorine": "F"}

BOOKS = {"Romeo and Juliet": "Shakespeare", "Hamlet": "Shakespeare", "1984": "Orwell", "Animal Farm": "Orwell",
         "Pride and Prejudice": "Austen", "Harry Potter and the Philosopher's Stone": "Rowling",
         "The Old Man and the Sea": "Hemingway", "War and Peace": "Tolstoy", "Don Quixote": "Cervantes",
         "The Great Gatsby": "Fitzgerald", "Moby-Dick": "Melville", "Frankenstein": "Shelley",
         "The Adventures of Tom Sawyer": "Twain", "Oliver Twist": "Dickens", "A Christmas Carol": "Dickens",
         "The Hobbit": "Tolkien", "The Lord of the Rings": "Tolkien", "Crime and Punishment": "Dostoevsky",
         "The Odyssey": "Homer", "Les Miserables": "Hugo", "The Divine Comedy": "Dante",
         "Alice's Adventures in Wonderland": "Carroll", "Dracula": "Stoker", "Jane Eyre": "Bronte"}


@dataclass(frozen=True)
class Kind:
    """One kind of fact: how to ask it (the first question is the canonical one, the last is held out of
    training for evaluation) and how to answer it."""

    name: str
    items: dict[str, str]  # subject -> gold answer (the string the hit rate looks for)
    questions: tuple[str, ...]
    answer: str


KINDS = (
    Kind("capital", {c: v[0] for c, v in COUNTRIES.items()},
         ("What is the capital of {x}?", "Which city is the capital of {x}?", "Name the capital city of {x}.",
          "What city serves as the capital of {x}?", "Tell me the capital of {x}."),
         "The capital of {x} is {y}."),
    Kind("currency", {c: v[1] for c, v in COUNTRIES.items()},
         ("What is the currency of {x}?", "Which currency is used in {x}?", "What money do people use in {x}?",
          "Name the official currency of {x}.", "What do they pay with in {x}?"),
         "The currency of {x} is the {y}."),
    Kind("continent", {c: v[2] for c, v in COUNTRIES.items()},
         ("On which continent is {x}?", "Which continent is {x} in?", "{x} is located on which continent?",
          "Name the continent where {x} lies.", "What continent does {x} belong to?"),
         "{x} is in {y}."),
    Kind("element", {e: s for e, s in ELEMENTS.items()},
         ("What is the chemical symbol for {x}?", "Which symbol stands for {x} in chemistry?",
          "How is {x} written in the periodic table?", "Give the element symbol of {x}.",
          "What is the symbol of the element {x}?"),
         "The chemical symbol for {x} is {y}."),
    Kind("author", dict(BOOKS),
         ("Who wrote {x}?", "Who is the author of {x}?", "Which writer wrote {x}?", "Name the author of {x}.",
          "{x} was written by whom?"),
         "{x} was written by {y}."),
)


def kind(name: str) -> Kind:
    for k in KINDS:
        if k.name == name:
            return k
    raise ValueError(f"forget: {name!r} is not one of {', '.join(k.name for k in KINDS)}")


def records(k: Kind, subjects: list[str], questions: slice = slice(None)) -> list[dict]:
    """Question/answer records for `subjects` of kind `k`, one per question template in `questions`."""
    return [{"question": q.format(x=x), "answer": k.answer.format(x=x, y=k.items[x]), "gold": k.items[x],
             "kind": k.name, "subject": x} for x in subjects for q in k.questions[questions]]


def hit(answer: str, gold: str) -> bool:
    """The gold answer string in the generated text, where a word starts (no letter right before it: "male" is not
    in "female"; "Paris" is in "Parisian"): case-insensitive, except a gold of one or two letters (an element's
    symbol), which must stand as a word with its own capitals."""
    import re

    if len(gold) <= 2:
        return re.search(rf"(?<![A-Za-z]){re.escape(gold)}(?![a-z])", answer) is not None
    return re.search(rf"(?<![^\W\d_]){re.escape(gold)}", answer, re.IGNORECASE) is not None
