"""The embedded default corpus: seeded children's stories with in-context repetition.

A stand-in for TinyStories/BabiStories (thesis App. B.2) that needs no download. Each story
introduces a main character, a friend, a pet and a treasured object, then mentions them again and
again ("... Zorbel gave the lantern to Mira. Mira smiled at Zorbel ..."). Half of the first names
are invented from syllables, so they are rare as unigrams: predicting their later occurrences needs
copying from the context, which a one-block Memory Mosaic can do (induction head in one layer) and
a one-block transformer cannot (thesis §3.5, App. B.4.2).

Variety: a dozen plot shapes, each a sequence of slots with several templates, `[a|b|c]` inline
alternatives, dialogue, pronouns that agree with each character, and paragraphs joined by "\\n".

Deterministic across runs and platforms: only `random.Random(seed)` is used, and nothing iterates a
set or a dict of strings in hash order. Bump `GENERATOR_VERSION` whenever the output changes (it
keys the token caches).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

GENERATOR_VERSION = 1
DEFAULT_TRAIN_STORIES = 20_000
DEFAULT_VAL_STORIES = 500
TRAIN_SEED = 20250101
VAL_SEED = 20250102

GIRL_NAMES = """Ada Alice Amara Amelia Anna Aria Aurora Ava Bella Bianca Briana Camila Chloe Clara Daisy
Dalia Elena Eliana Ella Elsa Emma Esme Eva Fatima Fiona Freya Gemma Grace Hana Hazel Ida Imani Iris
Isla Ivy Jade Jana Julia June Kaia Kira Lara Layla Lena Lila Lily Lina Lucia Luna Lydia Maya Mia
Mila Mira Nadia Naomi Nina Noor Nora Olive Olivia Paula Pearl Penny Piper Priya Quinn Rosa Rose
Ruby Sadie Sara Selma Sofia Stella Tara Thea Uma Vera Violet Wren Yara Yuki Zara Zoe Amina Beatrix
Cora Delia Edith Flora Greta Helga Ines Joy Kamala Leila Maren Nell Opal Petra Rhea Sana Talia Una
Vida Willa Xena Yasmin Zelda Agnes Bonnie Celia Dora Emmy Faye Gwen Hattie Ingrid Josie Keiko Lottie
Mabel Nia Odette Polly Romy Sunny Tilly Ursula Vivi Winnie""".split()

BOY_NAMES = """Aaron Adam Ali Amir Andre Arlo Arthur Ben Bruno Caleb Carlos Leo Dan David Diego Eli
Emil Eric Ezra Felix Finn Gabe George Hamza Hugo Ian Isaac Ivan Jack Jacob Jake James Jonah Jude
Kai Karl Kenji Leon Liam Lucas Luca Luis Malik Marco Max Milo Nico Noah Oliver Omar Oscar Otto Owen
Pablo Paul Pedro Quentin Rafael Ravi Ray Rio Rory Sam Santi Sebastian Simon Tariq Teo Theo Tom Toby
Tristan Umar Victor Wes Will Xavier Yusuf Zack Zane Abel Basil Cyrus Dario Enzo Floyd Gus Hector
Idris Jasper Kofi Lars Magnus Ned Orson Percy Rufus Silas Tobin Ulric Vance Wyatt Yuri Zeke Alfie
Bram Cal Dex Elio Fritz Gideon Hank Ira Joss Kit Linus Monty Nate Ollie Pip Reid Seth Ted Vito
Walt Yann Ziggy""".split()

PET_NAMES = """Biscuit Pepper Muffin Pickles Bubbles Noodle Peanut Waffles Sprout Button Cocoa Ginger
Hazelnut Jellybean Maple Nugget Oreo Pudding Rocket Scout Shadow Snowball Sparky Sunny Taffy Toffee
Whiskers Ziggy Banjo Clover Dumpling Fudge Gizmo Honey Inky Jasper Kiwi Lulu Marble Nutmeg Olive
Pebble Poppy Quill Rusty Sesame Tater Velvet Wiggles Yoyo Zephyr Acorn Bean Crumble Dotty Echo
Fig Goober Huckle Juniper Koko Lemon Mochi Nacho Pretzel Pumpkin Rascal Socks Tinker Truffle
Twix Wobble""".split()

SPECIES = """cat dog puppy kitten rabbit bunny turtle parrot hamster goat duck duckling frog owl pony
mouse hedgehog goldfish lamb piglet chick squirrel guinea-pig tortoise lizard gecko ferret
donkey calf budgie""".split()

OBJECTS = """lantern kite ball drum whistle hat scarf boot teddy robot boat train car truck crayon
book map compass shell stone feather ribbon button marble spoon cup bowl basket bucket shovel
blanket pillow umbrella balloon flute bell key box jar lamp clock mirror brush comb wagon sled
bicycle helmet necklace bracelet ring crown wand sword shield rope ladder tent flag puzzle
block doll puppet yo-yo top jump-rope telescope camera radio rocket plane glove mitten sock
sweater coat apron backpack notebook pencil paintbrush guitar violin harmonica trumpet""".split()

OBJECT_ADJS = """red blue green yellow purple orange pink shiny golden silver tiny big old new soft
striped spotted wooden paper magic bright sparkly little special round fluffy""".split()

PLACES = """the park|the garden|the beach|the forest|the river|the farm|the meadow|the hill|the
lake|the playground|the market|the library|the old barn|the pond|the school|the orchard|the
woods|the big field|the zoo|the harbor|the cave|the bakery|the bridge|the village square|the
mountain|the island|the windmill|the greenhouse|the attic|the backyard|the toy shop|the museum|
the train station|the lighthouse|the campsite|the castle""".replace("\n", " ").split("|")

TRAITS = """kind brave curious shy happy clever gentle cheerful funny careful busy little quiet
friendly""".split()

FEELINGS = "happy glad proud excited calm warm".split()
SAD_FEELINGS = "sad worried upset scared lonely grumpy".split()

SYLLABLE_ONSETS = """b br d dr f fl g gl gr j k kr l m n p pl pr r s sh sk sl st t th tr v w z
zh qu""".split()
SYLLABLE_VOWELS = "a e i o u a e i o u ai ee oo ia ou ie".split()
SYLLABLE_CODAS = ["", "", "", "n", "l", "r", "s", "th", "m", "x", "nd", "rk", "b", "k", "sh"]


@dataclass(frozen=True)
class _Character:
    """A named character and its pronouns (he/him/his or she/her/her)."""

    name: str
    girl: bool

    def pronouns(self, prefix: str) -> dict[str, str]:
        """Template fields {he} {him} {his} {kid} (+ {He} ...) with `prefix` "" or "f" ({fhe}, {Fhe})."""
        he, him, his = ("she", "her", "her") if self.girl else ("he", "him", "his")
        words = {"he": he, "him": him, "his": his, "kid": "girl" if self.girl else "boy"}
        out = {}
        for key, word in words.items():
            out[prefix + key] = word
            capital = (prefix.upper() + key) if prefix else key.capitalize()
            out[capital] = word.capitalize()
        return out


def invented_name(rng: random.Random) -> str:
    """A pronounceable made-up first name ("Zorbel", "Kriamon"): 2-3 syllables, rare by design."""
    n_syllables = 2 if rng.random() < 0.7 else 3
    parts = [rng.choice(SYLLABLE_ONSETS) + rng.choice(SYLLABLE_VOWELS) for _ in range(n_syllables)]
    return ("".join(parts) + rng.choice(SYLLABLE_CODAS)).capitalize()


def _first_name(rng: random.Random, girl: bool, avoid: tuple[str, ...]) -> str:
    """Half invented, half from the real-name pools; never equal to a name in `avoid`."""
    while True:
        name = invented_name(rng) if rng.random() < 0.5 else rng.choice(GIRL_NAMES if girl else BOY_NAMES)
        if name not in avoid:
            return name


def _cast(rng: random.Random) -> dict[str, str]:
    """Draw the story's characters, pet, object and place as template fields."""
    hero_girl = rng.random() < 0.5
    hero = _Character(_first_name(rng, hero_girl, ()), hero_girl)
    friend_girl = rng.random() < 0.5
    friend = _Character(_first_name(rng, friend_girl, (hero.name,)), friend_girl)
    pet = rng.choice(PET_NAMES) if rng.random() < 0.5 else invented_name(rng)
    while pet in (hero.name, friend.name):
        pet = invented_name(rng)
    fields = {"H": hero.name, "F": friend.name, "P": pet, "species": rng.choice(SPECIES).replace("-", " "),
              "obj": rng.choice(OBJECTS), "adj": rng.choice(OBJECT_ADJS), "place": rng.choice(PLACES),
              "place2": rng.choice(PLACES), "trait": rng.choice(TRAITS), "ftrait": rng.choice(TRAITS),
              "feel": rng.choice(FEELINGS), "sad": rng.choice(SAD_FEELINGS), "age": str(rng.randint(3, 9))}
    while fields["place2"] == fields["place"]:
        fields["place2"] = rng.choice(PLACES)
    fields.update(hero.pronouns(""))
    fields.update(friend.pronouns("f"))
    fields["Place"] = fields["place"][0].upper() + fields["place"][1:]
    return fields


# --- templates -------------------------------------------------------------------------------
# Fields: {H} hero, {F} friend, {P} pet name, {species}, {obj}, {adj}, {place}, {place2}, {Place},
# {trait}, {ftrait}, {feel}, {sad}, {age}; hero pronouns {he} {him} {his} {He} {His} {kid}; friend
# pronouns {fhe} {fhim} {fhis} {Fhe} {Fhis} {fkid}. `[a|b|c]` picks one alternative at random.

OPENINGS = [
    "Once upon a time, there was a {trait} {kid} named {H}.",
    "Once upon a time, in a small [town|village|house by the sea|cottage in the hills], there lived a {trait} {kid} called {H}.",
    "{H} was a {trait} {kid} who was {age} years old.",
    "There once was a {kid} named {H} who lived near {place}.",
    "One [sunny|rainy|windy|snowy|quiet] morning, a {trait} {kid} named {H} woke up early.",
    "In a [little|bright|busy|sleepy] town, there was a {kid} named {H}.",
    "{H} lived in a [small|yellow|blue|tiny|cozy] house next to {place}.",
    "Long ago, a {trait} {kid} named {H} lived with {his} [mom|dad|grandma|grandpa|family].",
    "Every day, a {trait} {kid} named {H} [went|walked|ran|skipped] to {place}.",
    "There was a {kid} called {H}. {He} was {age} years old and very {trait}.",
    "Once, a {trait} little {kid} named {H} [had a big dream|wanted an adventure|loved to play outside].",
    "In a [green|quiet|big|happy] land far away, there lived a {kid} named {H}.",
]

PET_INTROS = [
    "{H} had a {species} named {P}.",
    "{He} lived with {his} [little|fluffy|funny|old|clever] {species}, {P}.",
    "{H}'s best pet was a {species} called {P}.",
    "{H} [loved|liked|cared for] {his} {species}, {P}, very much.",
    "{P} was {H}'s [little|fluffy|funny|sleepy|playful] {species}.",
    "{H} and {his} {species} {P} went everywhere together.",
]

OBJECT_INTROS = [
    "{H}'s favorite thing was a {adj} {obj}.",
    "{He} loved {his} {adj} {obj} more than anything.",
    "{H} had a {adj} {obj} that {he} [kept|carried|took] everywhere.",
    "[Grandma|Grandpa|Mom|Dad] had given {H} a {adj} {obj}.",
    "{H} always [played with|looked after|took care of] {his} {adj} {obj}.",
    "One day, {H} found a {adj} {obj} [under the bed|in a box|near {place}|in the grass].",
]

FRIEND_INTROS = [
    "{H}'s best friend was a {ftrait} {fkid} named {F}.",
    "Every day, {H} played with {his} friend {F}.",
    "{H} had a friend called {F} who lived [next door|down the street|near {place}|across the road].",
    "{F} was {H}'s best friend, and {fhe} was very {ftrait}.",
    "{H} and {F} had been friends for a long time.",
    "{H} liked to play with {F}, a {ftrait} {fkid} from [school|the park|next door].",
]

# Each plot is a list of slots; each slot lists alternative templates.
PLOTS: dict[str, list[list[str]]] = {
    "lost": [
        ["One day, {H} [took|brought|carried] the {obj} to {place}.",
         "One [morning|afternoon|evening], {H} went to {place} with {his} {obj}."],
        ["When {he} came home, the {obj} was gone!",
         "Later, {H} looked for the {obj}, but {he} could not find it.",
         "Oh no! The {obj} was not there anymore."],
        ["{H} felt {sad}. \"Where is my {obj}?\" {he} [asked|cried|said].",
         "\"My {obj} is lost!\" said {H}. {He} was very {sad}."],
        ["{H} [ran|went|walked] to {F}'s house. \"Can you help me find my {obj}?\" {he} asked.",
         "{F} saw that {H} was {sad}. \"I will help you look for the {obj},\" said {F}."],
        ["{H} and {F} looked [everywhere|under the trees|behind the rocks|in the tall grass] at {place}.",
         "They searched {place} and then {place2}, but the {obj} was not there."],
        ["Then {P} the {species} [barked|jumped|ran off|sniffed the ground] and found the {obj}!",
         "Suddenly, {P} came back with the {obj}. The {species} had found it!"],
        ["{H} hugged {P}. \"Thank you, {P}!\" said {H}.",
         "\"You found my {obj}!\" {H} said to {P}, and {he} gave the {species} a big hug."],
        ["{H} thanked {F} too, and they played with the {obj} until dinner.",
         "{H} and {F} laughed, and {H} held the {obj} tight all the way home."],
    ],
    "share": [
        ["One day, {F} came to play and saw the {adj} {obj}.",
         "{F} visited {H} at {place} and saw {his} {obj}."],
        ["\"Can I play with your {obj}?\" asked {F}.",
         "\"Please, {H}, may I hold the {obj}?\" {F} asked."],
        ["\"No! It is my {obj},\" said {H}. {F} felt {sad}.",
         "But {H} did not want to share. \"The {obj} is mine,\" {he} said, and {F} looked {sad}."],
        ["{F} [walked away|sat down alone|went home] and {H} played with the {obj} by {him}self.",
         "{H} played alone, but it was not fun without {F}."],
        ["{P} the {species} looked at {H}. Even {P} seemed {sad}.",
         "Soon {H} felt {sad} too. {He} missed {F}."],
        ["{H} [ran|went|walked] to {F} and said, \"I am sorry, {F}. Let's play with the {obj} together.\"",
         "{H} went to find {F}. \"Here, {F}, you can have a turn with my {obj},\" said {H}."],
        ["{F} smiled at {H}. \"Thank you, {H}!\"",
         "{F} was so {feel}. {Fhe} hugged {H}."],
        ["{H} and {F} played with the {obj} all day, and {P} played with them.",
         "Together, {H}, {F} and {P} had the best day at {place}."],
    ],
    "trip": [
        ["One day, {H} and {F} decided to go to {place}.",
         "\"Let's go to {place}!\" said {H} to {F} one [sunny|bright|cool] morning."],
        ["{H} brought {his} {obj}, and {P} the {species} came too.",
         "They took the {adj} {obj} and {P}, {H}'s {species}."],
        ["At {place}, they [saw|found] [a big tree|a funny bird|a little stream|many flowers|a long path].",
         "When they got to {place}, {F} [laughed|shouted|clapped]. It was [beautiful|so big|very green]."],
        ["But then [it got dark|the sky turned gray|a big wind came|they lost the path].",
         "Suddenly, [the sun went down|it began to rain|they heard a loud noise]. {F} was {sad}."],
        ["\"Don't worry, {F},\" said {H}. \"I have my {obj}.\"",
         "{H} held up the {obj}. \"We will be okay,\" {he} told {F}."],
        ["The {obj} helped them find the way, and {P} ran in front of them.",
         "With the {obj} and {P}, {H} and {F} found the road back home."],
        ["{F} said, \"You are a good friend, {H}.\"",
         "When they got home, {F} thanked {H} for being so brave."],
        ["{H} smiled at {F}. It had been a big adventure.",
         "That night, {H} put the {obj} by the bed and dreamed of {place}."],
    ],
    "gift": [
        ["It was {F}'s birthday, and {H} wanted to give {fhim} a present.",
         "{H} knew that {F}'s birthday was [tomorrow|soon|next week]."],
        ["{H} thought and thought. What could {he} give {F}?",
         "\"What does {F} like?\" {H} asked {P}. The {species} [wagged its tail|blinked|made a funny sound]."],
        ["Then {H} looked at {his} {adj} {obj}.",
         "{H} saw {his} {obj} and had an idea."],
        ["{He} loved the {obj}, but {he} loved {F} more.",
         "It was {his} favorite {obj}, but {H} wanted {F} to be {feel}."],
        ["{H} [wrapped the {obj} in paper|put the {obj} in a box|tied a ribbon on the {obj}] and walked to {F}'s house with {P}.",
         "{H} and {P} took the {obj} to {F} at {place}."],
        ["\"Happy birthday, {F}!\" said {H}, and {he} gave {F} the {obj}.",
         "{H} gave the {obj} to {F}. \"This is for you, {F},\" {he} said."],
        ["{F} was so {feel}. \"Thank you, {H}! I love the {obj}!\"",
         "{F} smiled at {H}. \"It is the best present ever, {H}.\""],
        ["From that day on, {F} kept the {obj} [by {fhis} bed|in a safe place|with {fhim} everywhere] and always thought of {H}.",
         "{H} learned that giving can make you as {feel} as getting."],
    ],
    "rescue": [
        ["One day, {P} the {species} ran to {place} and did not come back.",
         "One [morning|afternoon], {H} could not find {P} anywhere."],
        ["{H} was {sad}. \"{P}! Where are you, {P}?\" {he} called.",
         "\"Where is {P}?\" {H} asked {F}. They were both {sad}."],
        ["{H} and {F} ran to {place}. There was {P}, stuck [up in a tree|on a rock in the water|in a deep hole|behind a fence].",
         "At {place}, they heard a small sound. {P} was stuck [in a bush|up high on a wall|under a log]."],
        ["\"I can help!\" said {F}. But {fhe} could not reach {P}.",
         "{H} tried to reach {P}, but {he} was too small."],
        ["Then {H} had an idea. {He} used {his} {obj} to help {P}.",
         "{H} held out the {obj}, and {P} [climbed onto it|grabbed it|jumped toward it]."],
        ["{P} was free! The {species} jumped into {H}'s arms.",
         "At last, {P} was safe. {H} hugged {P} and {F} cheered."],
        ["\"Good job, {H}!\" said {F}. \"Your {obj} saved {P}!\"",
         "{F} smiled at {H}. \"That was very clever, {H}.\""],
        ["From then on, {H} always kept the {obj} close, just in case.",
         "{H}, {F} and {P} walked home together, {feel} and tired."],
    ],
    "race": [
        ["One day, {F} said, \"{H}, let's race to {place}!\"",
         "{H} and {F} liked to race. One day they raced to {place}."],
        ["\"Ready, set, go!\" shouted {H}, and they ran.",
         "They ran as fast as they could. {P} the {species} ran after them."],
        ["{F} was [fast|very fast|faster], but then {fhe} [fell down|tripped on a stone|hurt {fhis} knee].",
         "Halfway there, {F} fell and dropped {fhis} shoe. {Fhe} was {sad}."],
        ["{H} could win the race, but {he} stopped to help {F}.",
         "{H} saw {F} on the ground and [stopped|turned back|ran to {fhim}]."],
        ["\"Are you okay, {F}?\" asked {H}. {He} gave {F} {his} {obj} to hold.",
         "{H} helped {F} up and let {fhim} hold the {obj}."],
        ["{P} licked {F}'s hand, and {F} laughed.",
         "{F} smiled at {H}. \"Thank you, {H}. You are a true friend.\""],
        ["They walked to {place} together, and nobody won the race.",
         "{H} and {F} got to {place} at the same time, holding hands."],
        ["{H} learned that helping a friend is better than winning.",
         "That day, {H} and {F} learned that friends are more important than races."],
    ],
    "fear": [
        ["One night, there was a big storm. {H} was afraid of the [thunder|dark|wind|noise].",
         "{H} did not like the dark. Every night {he} felt {sad}."],
        ["{He} hid under {his} blanket with {P} the {species}.",
         "{H} held {P} close, but {he} was still {sad}."],
        ["The next day, {H} told {F} about it.",
         "In the morning, {H} went to see {F} at {place}."],
        ["\"I am scared at night,\" said {H}. {F} listened.",
         "\"The night is so dark,\" {H} told {F}. \"I don't like it.\""],
        ["{F} said, \"Your {obj} can keep you company. And {P} is with you too.\"",
         "\"When I am scared, I think of happy things,\" said {F}. \"Hold your {obj} and think of {P}.\""],
        ["That night, {H} held the {obj} and looked at {P}.",
         "When the night came, {H} put the {obj} next to {his} pillow."],
        ["{H} was not scared anymore. {He} smiled and went to sleep.",
         "The dark did not seem so bad now. {H} slept well."],
        ["The next day, {H} said, \"Thank you, {F}! I was brave!\"",
         "{H} told {F}, \"Your idea worked, {F}!\" and they both laughed."],
    ],
    "learn": [
        ["{H} wanted to learn to [swim|ride a bike|bake a cake|climb a tree|fly a kite|sing a song].",
         "More than anything, {H} wanted to learn something new."],
        ["{He} tried once, but {he} [fell|failed|made a mess|gave up].",
         "The first time {H} tried, it did not work. {He} felt {sad}."],
        ["\"I can't do it,\" said {H}, and {he} sat down next to {P}.",
         "{H} threw {his} {obj} on the ground. \"It is too hard!\" {he} said."],
        ["{F} came by and saw {H}. \"Don't give up, {H},\" {fhe} said.",
         "Then {F} came to {place}. \"I will help you, {H},\" said {F}."],
        ["{F} showed {H} how to do it, step by step.",
         "{H} and {F} tried again and again. {P} watched them."],
        ["At last, {H} did it! {He} was so {feel}.",
         "After many tries, {H} could finally do it. {H} jumped for joy."],
        ["\"You did it, {H}!\" said {F}, and {P} the {species} [barked|jumped|ran in circles].",
         "{H} hugged {F}. \"Thank you, {F}! I could not do it without you.\""],
        ["{H} learned that trying again is how we grow.",
         "From that day, {H} never gave up, and {he} always kept {his} {obj} for luck."],
    ],
    "mess": [
        ["One day, {H} and {P} played with the {obj} in the house.",
         "{H} was playing with {his} {obj} inside, and {P} the {species} joined in."],
        ["They played so much that they [broke a vase|made a big mess|spilled the milk|knocked over a lamp].",
         "Crash! {P} jumped and knocked the {obj} into a [vase|plate|cup], and it broke."],
        ["{H} was {sad}. \"What will Mom say?\" {he} asked {P}.",
         "\"Oh no,\" said {H}. {He} wanted to hide the mess."],
        ["{F} came over and saw the mess. \"You should tell the truth, {H},\" said {F}.",
         "{H} called {F}. {F} said, \"It is better to be honest, {H}.\""],
        ["{H} went to {his} mom and said, \"I am sorry. I made a mess with my {obj}.\"",
         "{H} told the truth about the {obj} and the mess."],
        ["Mom smiled. \"Thank you for telling me, {H}.\"",
         "Mom was not angry. She was proud of {H} for being honest."],
        ["{H}, {F} and {P} cleaned up the mess together.",
         "Together, {H} and {F} cleaned everything, and {P} helped too."],
        ["{H} learned that telling the truth is always best.",
         "After that, {H} played with the {obj} outside at {place}."],
    ],
    "new_friend": [
        ["One day, a new {fkid} named {F} came to {place}.",
         "One morning at {place}, {H} saw a {fkid} {he} had never seen before. {Fhis} name was {F}."],
        ["{F} sat alone and looked {sad}.",
         "{F} did not know anyone, so {fhe} stood by {fhim}self."],
        ["{H} walked over with {his} {obj} and {P}. \"Hi! I am {H},\" {he} said.",
         "{H} took {his} {obj} and went to say hello to {F}."],
        ["\"I am {F},\" said the {fkid}. \"I like your {obj}.\"",
         "{F} smiled a little. \"Hello, {H}. Is that your {species}?\""],
        ["\"This is {P},\" said {H}. \"Do you want to play with us, {F}?\"",
         "{H} showed {F} how to play with the {obj}, and {P} [jumped|ran|rolled] around them."],
        ["{F} and {H} played until the sun went down.",
         "Soon {F} was laughing with {H} and {P}."],
        ["{F} said, \"Thank you, {H}. I am not lonely anymore.\"",
         "At the end of the day, {F} hugged {H}."],
        ["From that day on, {H} and {F} were best friends.",
         "{H} learned that a small hello can make a new friend."],
    ],
}

ENDINGS = [
    "And they all lived happily, {H}, {F} and {P} the {species}.",
    "{H} and {F} were the best of friends forever.",
    "From then on, {H} took {his} {obj} to {place} every day.",
    "{H} smiled. It was a [good|great|wonderful|happy] day.",
    "That night, {H} told {P} all about the day, and the {species} fell asleep.",
    "{H} and {F} could not wait to play again [tomorrow|the next day|soon].",
    "The end.",
    "And {P} the {species} was {feel} too.",
]

_ALTERNATIVES = re.compile(r"\[([^\[\]]*)\]")


def _render(template: str, fields: dict[str, str], rng: random.Random) -> str:
    """Pick each `[a|b]` alternative with `rng` (left to right), then fill the `{field}`s."""
    text = _ALTERNATIVES.sub(lambda m: rng.choice(m.group(1).split("|")), template)
    text = text.format(**fields)
    return text[0].upper() + text[1:]


@dataclass(frozen=True)
class StoryRecord:
    """A story and its cast, for analyses such as the loss on repeated names."""

    text: str
    hero: str
    friend: str
    pet: str
    obj: str


def _story(rng: random.Random) -> StoryRecord:
    """One story: opening, introductions (shuffled), a plot, an ending; 3 paragraphs."""
    fields = _cast(rng)
    intros = [rng.choice(PET_INTROS), rng.choice(OBJECT_INTROS), rng.choice(FRIEND_INTROS)]
    rng.shuffle(intros)
    plot_name = rng.choice(sorted(PLOTS))
    # "new_friend" introduces the friend itself; the others may skip an intro for variety.
    if plot_name == "new_friend":
        intros = [t for t in intros if t not in FRIEND_INTROS]
    elif rng.random() < 0.25:
        intros.pop(rng.randrange(len(intros)))
    plot = [rng.choice(slot) for slot in PLOTS[plot_name]]
    first = [rng.choice(OPENINGS), *intros]
    if rng.random() < 0.6:
        plot.append(rng.choice(ENDINGS))
    cut = rng.randint(3, len(plot) - 2)
    paragraphs = [first, plot[:cut], plot[cut:]]
    text = "\n".join(" ".join(_render(t, fields, rng) for t in par) for par in paragraphs)
    return StoryRecord(text, fields["H"], fields["F"], fields["P"], fields["obj"])


def iter_story_records(n: int, seed: int) -> Iterator[StoryRecord]:
    """Lazily yield `n` stories with their cast from `random.Random(seed)`."""
    rng = random.Random(seed)
    for _ in range(n):
        yield _story(rng)


def iter_stories(n: int, seed: int) -> Iterator[str]:
    """Lazily yield the `n` stories of `generate_stories(n, seed)`."""
    for record in iter_story_records(n, seed):
        yield record.text


def generate_stories(n: int, seed: int) -> list[str]:
    """`n` stories from `random.Random(seed)`: same output on every run and platform."""
    return list(iter_stories(n, seed))


def default_story_splits(n_train: int = DEFAULT_TRAIN_STORIES,
                         n_val: int = DEFAULT_VAL_STORIES) -> tuple[list[str], list[str]]:
    """The default corpus: (train, val) drawn from two fixed seeds, so val never shares a stream."""
    return generate_stories(n_train, TRAIN_SEED), generate_stories(n_val, VAL_SEED)
