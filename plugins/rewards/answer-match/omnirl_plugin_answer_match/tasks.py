"""A small multiple-choice task: the default prompts of ``answer-match``.

The correct letters are spread over A-D, so a policy can only score well by reading the question (a fixed
letter earns 1/4 at best). A random-weight tiny model learns it in about a minute on a CPU, with the tiny
preset's guided choice (sampling restricted to the letters and the stop token).
"""

CHOICE_QUESTIONS = [
    {"prompt": "What colour is a clear daytime sky? A) green B) blue C) red D) black. Answer with the letter.",
     "answer": "B"},
    {"prompt": "How many legs does a cat have? A) four B) two C) six D) eight. Answer with the letter.",
     "answer": "A"},
    {"prompt": "Which one is a fruit? A) chair B) car C) apple D) cup. Answer with the letter.",
     "answer": "C"},
    {"prompt": "What is 2 + 2? A) 3 B) 5 C) 6 D) 4. Answer with the letter.",
     "answer": "D"},
    {"prompt": "Which animal barks? A) cat B) dog C) fish D) bird. Answer with the letter.",
     "answer": "B"},
    {"prompt": "What shape is a ball? A) sphere B) cube C) square D) line. Answer with the letter.",
     "answer": "A"},
    {"prompt": "Which grows in the sea? A) oak tree B) cactus C) seaweed D) wheat. Answer with the letter.",
     "answer": "C"},
    {"prompt": "What is the opposite of hot? A) warm B) loud C) big D) cold. Answer with the letter.",
     "answer": "D"},
]
