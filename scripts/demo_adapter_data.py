"""The demo adapters' training data and settings (scripts/train_demo_adapters.py): hand-written
short answers to a few dozen questions, each transformed per behaviour there, and each
adapter's PEFT config and training knobs."""

from __future__ import annotations

SEED = 1234

# (question, short answer, one-word answer). None of these are in HELD_OUT_PROMPTS.
QA: tuple[tuple[str, str, str], ...] = (
    ("What is the capital of France?", "The capital of France is Paris.", "Paris"),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day.", "Blue"),
    ("How many days are in a week?", "There are seven days in a week.", "Seven"),
    (
        "What is the largest planet in our solar system?",
        "Jupiter is the largest planet.",
        "Jupiter",
    ),
    ("What do plants need to make food?", "Plants need sunlight to make food.", "Sunlight"),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet.", "Shakespeare"),
    (
        "What is the boiling point of water in Celsius?",
        "Water boils at 100 degrees Celsius.",
        "100",
    ),
    ("Which animal says moo?", "A cow says moo.", "Cow"),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo.", "Tokyo"),
    ("What gas do humans breathe in to live?", "Humans breathe in oxygen.", "Oxygen"),
    ("How many continents are there?", "There are seven continents.", "Seven"),
    ("What is the color of grass?", "Grass is green.", "Green"),
    ("Which fruit keeps the doctor away?", "An apple a day keeps the doctor away.", "Apple"),
    ("What is the fastest land animal?", "The cheetah is the fastest land animal.", "Cheetah"),
    ("What do you use to write on a blackboard?", "You write on a blackboard with chalk.", "Chalk"),
    (
        "What is the main language spoken in Brazil?",
        "People in Brazil speak Portuguese.",
        "Portuguese",
    ),
    ("Which star is closest to Earth?", "The Sun is the closest star to Earth.", "Sun"),
    ("What is the tallest animal?", "The giraffe is the tallest animal.", "Giraffe"),
    ("What is two plus two?", "Two plus two is four.", "Four"),
    (
        "Which organ pumps blood through the body?",
        "The heart pumps blood through the body.",
        "Heart",
    ),
    ("What do caterpillars turn into?", "Caterpillars turn into butterflies.", "Butterflies"),
    ("What is the capital of Germany?", "The capital of Germany is Berlin.", "Berlin"),
    ("What falls from clouds when it rains?", "Water falls from clouds as rain.", "Water"),
    ("Which month comes after June?", "July comes after June.", "July"),
    ("What instrument has black and white keys?", "A piano has black and white keys.", "Piano"),
    ("What is the opposite of up?", "The opposite of up is down.", "Down"),
    ("What do birds use to fly?", "Birds use their wings to fly.", "Wings"),
    (
        "Which metal is liquid at room temperature?",
        "Mercury is liquid at room temperature.",
        "Mercury",
    ),
    ("What is the largest desert in the world?", "Antarctica is the largest desert.", "Antarctica"),
    ("What do we call a baby dog?", "A baby dog is called a puppy.", "Puppy"),
    ("What shape has three sides?", "A triangle has three sides.", "Triangle"),
    (
        "What is the freezing point of water in Celsius?",
        "Water freezes at zero degrees Celsius.",
        "Zero",
    ),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa.", "Leonardo"),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa.", "Ottawa"),
    ("How many hours are in a day?", "There are twenty-four hours in a day.", "Twenty-four"),
    ("What do pandas eat?", "Pandas mostly eat bamboo.", "Bamboo"),
    ("Which direction does the sun rise in?", "The sun rises in the east.", "East"),
    (
        "What is the hardest natural material?",
        "Diamond is the hardest natural material.",
        "Diamond",
    ),
    (
        "What do you call a group of stars that forms a picture?",
        "That is called a constellation.",
        "Constellation",
    ),
    ("What is the main ingredient in bread?", "The main ingredient in bread is flour.", "Flour"),
    ("Tell me something about dogs.", "Dogs are loyal and friendly animals.", "Loyal"),
    ("Give me a tip for sleeping better.", "Go to bed at the same time every night.", "Routine"),
    ("Why do we need to drink water?", "Our bodies need water to stay healthy.", "Health"),
    ("Describe the ocean in a sentence.", "The ocean is vast, deep and full of life.", "Vast"),
    ("What is your favorite season?", "I like spring because flowers bloom.", "Spring"),
    ("How do you make a cup of tea?", "Steep a tea bag in hot water for a few minutes.", "Steep"),
    ("What is a good way to stay healthy?", "Eat well and exercise every day.", "Exercise"),
    ("Explain what a computer does.", "A computer processes information very quickly.", "Computes"),
)

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# name -> PEFT config + training knobs (different configs exercise different engine paths).
ADAPTER_SETTINGS: dict[str, dict] = {
    # q_proj + v_proj of the top 12 layers
    "caps": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        use_rslora=False,
        top_layers=12,
        steps=40,
        lr=3e-3,
    ),
    # all seven linear modules of the top 16 layers, rank-stabilised scaling (alpha / sqrt(r))
    "signoff": dict(
        r=16,
        lora_alpha=8,
        target_modules=list(ALL_LINEAR),
        use_rslora=True,
        top_layers=16,
        steps=30,
        lr=1e-3,
    ),
    # the MLP (gate_proj, up_proj, down_proj) of the top 12 layers
    "oneword": dict(
        r=8,
        lora_alpha=16,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        use_rslora=False,
        top_layers=12,
        steps=30,
        lr=3e-3,
    ),
}
BATCH_SIZE = 8
