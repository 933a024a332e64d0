"""Chat prompts for SmolLM2's drafts: written here, combined from templates, split by subject.

Every prompt is a template filled with one subject (a topic, a task, a thing, ...). A subject goes to the
held-out set when `sha256(subject) % 10 == 0`, so no held-out prompt shares its subject with a training
prompt: the drafts are measured on questions about things they never saw asked.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

TOPICS = """photosynthesis; black holes; the water cycle; plate tectonics; the French Revolution; the Roman Empire;
the industrial revolution; climate change; renewable energy; nuclear fusion; the human immune system; DNA;
evolution by natural selection; the theory of relativity; quantum computing; machine learning; neural networks;
the internet; blockchain; cryptography; the stock market; inflation; supply and demand; compound interest;
the Renaissance; the Cold War; the printing press; the moon landing; volcanoes; earthquakes; hurricanes;
the ozone layer; coral reefs; rainforests; deserts; the Great Wall of China; ancient Egypt; the pyramids;
democracy; the United Nations; human rights; the scientific method; gravity; magnetism; electricity;
the periodic table; chemical reactions; acids and bases; the solar system; Mars; Jupiter; the Sun; comets;
the Big Bang; galaxies; the speed of light; sound waves; rainbows; the seasons; tides; the human brain;
sleep; memory; dreams; nutrition; vitamins; exercise; meditation; stress; the heart; blood pressure;
vaccines; antibiotics; bacteria; viruses; the digestive system; bees; ants; whales; dolphins; elephants;
migration of birds; dinosaurs; fossils; the Ice Age; agriculture; the history of writing; languages;
music theory; jazz; classical music; the guitar; painting; impressionism; photography; cinema; theater;
poetry; the novel; Shakespeare; Greek mythology; philosophy; ethics; logic; critical thinking; happiness;
friendship; leadership; teamwork; time management; public speaking; negotiation; marketing; startups;
economics; taxes; banking; credit scores; budgeting; saving money; investing; real estate; cloud computing;
databases; operating systems; programming languages; Python; JavaScript; web browsers; search engines;
social media; smartphones; batteries; electric cars; airplanes; rockets; satellites; GPS; robots;
3D printing; artificial intelligence; computer viruses; passwords; open source software; Linux; email;
the history of computers; video games; chess; football; the Olympic Games; marathons; yoga; swimming;
cooking; baking bread; coffee; tea; chocolate; cheese; fermentation; spices; vegetarian diets; gardening;
composting; recycling; plastic pollution; air pollution; clean water; oceans; rivers; mountains; glaciers;
weather forecasting; clouds; lightning; snow; wind power; solar panels; hydroelectric dams; oil; natural gas;
the metric system; prime numbers; fractions; geometry; algebra; probability; statistics; calculus; infinity;
the Pythagorean theorem; pi; zero; maps; time zones; calendars; clocks; money; trade; globalization;
cities; architecture; bridges; skyscrapers; trains; ships; bicycles; the Silk Road; the Vikings;
the Middle Ages; castles; knights; samurai; the Aztecs; the Incas; the Industrial Age; electric light;
the telephone; radio; television; newspapers; libraries; schools; universities; online learning;
learning a new language; reading habits; writing essays; note taking; creativity; curiosity; empathy;
kindness; honesty; patience; habits; motivation; goals; minimalism; volunteering; pets; dogs; cats;
horses; owls; sharks; octopuses; butterflies; trees; flowers; mushrooms; seeds; soil; rain;
the Amazon river; the Sahara; Antarctica; the Arctic; islands; caves; the deep sea; tsunamis;
the human skeleton; muscles; the eye; hearing; taste; smell; skin; hair; teeth; breathing; lungs"""

TASKS = """learn to cook pasta; start running; improve my sleep; save money each month; learn Python; write a resume;
prepare for a job interview; make new friends; study for an exam; plant a vegetable garden; bake cookies;
make a cup of tea; clean my kitchen; organize my desk; learn to play the guitar; start a blog; speak in public;
reduce stress; drink more water; stay focused while working; wake up early; learn to draw; take better photos;
write a short story; read more books; plan a trip; pack a suitcase; change a flat tire; fix a leaky faucet;
paint a room; care for a houseplant; train a puppy; start meditating; learn to swim; ride a bicycle;
make a budget; pay off debt; start investing; negotiate a salary; write a cover letter; manage my time;
set goals for the year; build a habit; break a bad habit; learn a new language; memorize vocabulary;
give feedback to a colleague; run a meeting; write a good email; apologize to a friend; handle criticism;
stay motivated; make a healthy breakfast; meal prep for the week; make a smoothie; brew coffee at home;
make bread; make soup; grill vegetables; keep my phone secure; create a strong password; back up my files;
speed up my computer; learn to type faster; build a website; learn SQL; debug my code; use git;
write unit tests; learn data analysis; make a presentation; take notes in class; write an essay;
improve my handwriting; learn chess; solve a Rubik's cube; start journaling; be more patient;
become a better listener; calm down when angry; deal with procrastination; decorate a small apartment;
choose a laptop; compare phone plans; recycle at home; reduce food waste; save energy at home;
grow tomatoes; make compost; prepare for a hurricane; build a campfire; go camping; hike safely;
take care of my eyes; stretch after exercise; improve my posture; start lifting weights; run a marathon;
teach a child to read; help a friend who is sad; plan a birthday party; write a thank you note;
choose a good book; start a small business; find a mentor; ask for a promotion; learn to knit;
sew a button; iron a shirt; do laundry; remove a stain; fold a fitted sheet; learn to juggle"""

THINGS = """the ocean; a rainy day; the moon; a lost cat; an old lighthouse; autumn leaves; a city at night;
a mountain village; a robot who learns to paint; a dragon who is afraid of fire; a friendly ghost; a time machine;
a magic library; the first day of school; a summer storm; a quiet forest; a busy market; a train journey;
a snowman; a secret garden; a brave mouse; a talking tree; a starry sky; the desert at dawn; a river;
a forgotten key; an astronaut; a small bakery; a lonely whale; a kite; a birthday cake; a violin;
a candle; a garden in spring; a winter morning; a bridge; an island; a wise owl; a clockmaker;
a young inventor; a pirate ship; a haunted house; a sunflower; the wind; a mirror; a letter from the past;
a cup of coffee; a sleepy town; a red balloon; a hidden cave; a lighthouse keeper; a fox in the snow;
a map to treasure; a new planet; a shy giant; a music box; a butterfly; a thunderstorm; a puppy;
a grandmother's recipe; a lost umbrella; a tiny robot; a city of glass; the last leaf; a paper boat"""

CODE_TASKS = """reverses a string; checks if a number is prime; returns the factorial of n; sorts a list of numbers;
counts the words in a sentence; finds the largest number in a list; checks if a word is a palindrome;
computes the Fibonacci sequence; removes duplicates from a list; converts Celsius to Fahrenheit;
merges two sorted lists; counts vowels in a string; finds the average of a list; reads a file line by line;
returns the sum of the digits of a number; capitalizes every word in a sentence; checks if two strings are anagrams;
flattens a nested list; finds the second largest number; converts a decimal number to binary;
computes the greatest common divisor; generates a random password; validates an email address;
counts how often each letter appears; returns the n-th prime; rotates a list by k places;
finds common elements of two lists; computes the area of a circle; checks for balanced parentheses;
implements binary search; implements bubble sort; transposes a matrix; removes whitespace from a string;
splits a list into chunks; returns the median of a list; converts a string to title case;
counts lines in a text file; finds the longest word in a sentence; computes a running total"""

PEOPLE = """my boss; my teacher; a customer; my landlord; a new colleague; my team; a friend; my neighbor;
a job recruiter; my professor; a client; my manager; the school principal; a hotel; a restaurant owner"""

EMAIL_SUBJECTS = """a missed deadline; a meeting next week; a refund request; a job application; a sick day;
a project update; a thank you for help; a price question; a broken product; a schedule change;
a request for feedback; a new idea for the team; a late payment; a room booking; a course question"""

FEELINGS = """tired all the time; nervous about an exam; lonely in a new city; bored at work; stressed about money;
unmotivated to exercise; overwhelmed by my tasks; anxious before a presentation; sad after a breakup;
frustrated with my progress"""

SENTENCES = """the meeting was moved to tomorrow because the manager is sick; i think we should try the new
restaurant downtown; the report has some mistakes that need fixing; thanks for helping me with the project;
the weather is very cold today so wear a jacket; we are out of milk and bread; the train was late again this
morning; can you send me the file before noon; my computer keeps crashing when i open the browser;
the children played in the park until sunset; please remember to lock the door when you leave;
the book was much better than the movie; our team won the game last night; the price of coffee went up;
i will be working from home on friday"""

EXPLAIN = ["Explain {} in simple terms.", "What is {}?", "Can you tell me about {}?", "Give me a short summary of {}.",
           "Why is {} important?", "What are the main ideas behind {}?", "Explain {} to a ten year old.",
           "List five interesting facts about {}.", "What are common misconceptions about {}?",
           "Write a short paragraph about {}.", "How does {} work?", "What should a beginner know about {}?"]
HOW_TO = ["How do I {}?", "What is the best way to {}?", "Give me step-by-step instructions to {}.",
          "What are some tips to {}?", "I want to {}. Where should I start?", "Can you help me {}?"]
CREATIVE = ["Write a short poem about {}.", "Write a short story about {}.", "Write a haiku about {}.",
            "Describe {} in three sentences.", "Write a children's story about {}.", "Write a limerick about {}."]
CODE = ["Write a Python function that {}.", "Show me how to write a function in Python that {}.",
        "Write a JavaScript function that {}.", "Explain how to write a program that {}."]
COMPARE = ["What is the difference between {} and {}?", "Compare {} and {}.", "How are {} and {} related?"]
EMAIL = ["Write an email to {} about {}.", "Write a polite message to {} about {}."]
FEEL = ["I feel {}. What should I do?", "I have been {} lately. Any advice?"]
REWRITE = ["Rewrite this sentence to be more formal: \"{}\"", "Fix the grammar in this sentence: \"{}\"",
           "Translate this sentence into French: \"{}\"", "Make this sentence more polite: \"{}\""]
MATH = ["What is {} plus {}?", "What is {} times {}?", "If I have {} apples and give away {}, how many are left?",
        "What is {} minus {}?"]


def _split(text: str, sep: str = ";") -> list[str]:
    return [part.strip() for part in text.replace("\n", " ").split(sep) if part.strip()]


def is_heldout(subject: str) -> bool:
    return int(hashlib.sha256(subject.encode()).hexdigest(), 16) % 10 == 0


def _single(templates: list[str], subjects: list[str]) -> Iterator[tuple[str, str]]:
    for subject in subjects:
        for template in templates:
            yield subject, template.format(subject)


def _paired(rng: random.Random, templates: list[str], firsts: list[str], seconds: list[str],
            count: int) -> Iterator[tuple[str, str]]:  # fmt: skip
    for _ in range(count):
        a, b = rng.choice(firsts), rng.choice(seconds)
        if a != b:
            yield f"{a} | {b}", rng.choice(templates).format(a, b)


def all_prompts(seed: int = 0) -> list[tuple[str, str]]:
    """(subject, prompt) pairs, deduplicated, in a fixed shuffled order."""
    rng = random.Random(seed)
    topics = _split(TOPICS)
    pairs = [*_single(EXPLAIN, topics), *_single(HOW_TO, _split(TASKS)), *_single(CREATIVE, _split(THINGS)),
             *_single(CODE, _split(CODE_TASKS)), *_single(REWRITE, _split(SENTENCES)),
             *_single(FEEL, _split(FEELINGS)),
             *_paired(rng, COMPARE, topics, topics, 400),
             *_paired(rng, EMAIL, _split(PEOPLE), _split(EMAIL_SUBJECTS), 150)]  # fmt: skip
    numbers = [str(n) for n in range(2, 200)]
    pairs += list(_paired(rng, MATH, numbers, numbers, 150))
    unique = list(dict.fromkeys(pairs))
    rng.shuffle(unique)
    return unique


def split_prompts(seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held-out) prompt texts; a paired subject is held out when either of its parts is."""
    train, heldout = [], []
    for subject, prompt in all_prompts(seed):
        held = any(is_heldout(part.strip()) for part in subject.split("|"))
        (heldout if held else train).append(prompt)
    return train, heldout


if __name__ == "__main__":
    train, heldout = split_prompts()
    print(f"{len(train)} train prompts, {len(heldout)} held out")
    for prompt in heldout[:10]:
        print(" ", prompt)
