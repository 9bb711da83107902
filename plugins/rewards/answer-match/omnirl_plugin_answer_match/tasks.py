"""A small multiple-choice task: the default prompts of ``answer-match``.

Eight everyday questions whose correct option is always listed under B. A random-weight tiny model cannot
tell its prompts apart well enough to learn a different letter per question in minutes (measured: it settles
on one letter for all); a fixed letter is learnable in a few dozen steps on a CPU, with the tiny preset's
guided choice (sampling restricted to the letters and the stop token): the policy must learn to answer B and
stop. For a task that needs the prompt read, bring a .jsonl of questions (data.prompts).
"""

CHOICE_QUESTIONS = [
    {"prompt": "What colour is a clear daytime sky? A) green B) blue C) red D) black. Answer with the letter.",
     "answer": "B"},
    {"prompt": "How many legs does a cat have? A) two B) four C) six D) eight. Answer with the letter.",
     "answer": "B"},
    {"prompt": "Which one is a fruit? A) chair B) apple C) car D) cup. Answer with the letter.",
     "answer": "B"},
    {"prompt": "What is 2 + 2? A) 3 B) 4 C) 5 D) 6. Answer with the letter.",
     "answer": "B"},
    {"prompt": "Which animal barks? A) cat B) dog C) fish D) bird. Answer with the letter.",
     "answer": "B"},
    {"prompt": "What shape is a ball? A) cube B) sphere C) square D) line. Answer with the letter.",
     "answer": "B"},
    {"prompt": "Which grows in the sea? A) oak tree B) seaweed C) cactus D) wheat. Answer with the letter.",
     "answer": "B"},
    {"prompt": "What is the opposite of hot? A) warm B) cold C) loud D) big. Answer with the letter.",
     "answer": "B"},
]
