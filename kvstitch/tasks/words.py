"""Word lists for the synthetic tasks: the raw material of the essay haystack, needle keys and CWE lists.

Embedded (not downloaded) so that generation is offline and byte-for-byte reproducible. Names and cities
are kept out of the haystack vocabulary so a two-hop answer can never appear by accident in filler text.
"""

from __future__ import annotations

NOUNS: tuple[str, ...] = tuple("""
account advice airport album anchor angle animal answer apple argument army artist attempt audience
author balance balloon band bank basket battery beach bicycle bird blanket boat book border bottle
branch bread bridge brother budget building butter cabinet camera candle canvas captain carpet castle
century chair chapter cheese chicken chimney circle climate clock cloud coast coffee collar college
comet company compass computer concert contract corner cottage country cousin crystal culture
customer dancer decision desert design detail diamond diary dinner doctor dragon drawer dream editor
engine essay evening factory farmer feather festival field finger forest fountain friend garden
garage glacier guitar hammer harbor harvest helmet highway history hobby horizon hospital hotel
island jacket journal journey kettle kitchen ladder lantern lawyer lecture letter library machine
magnet manager market meadow memory message meteor method minute mirror monkey morning mountain
museum needle network notebook novel ocean office orchard painter palace paper parcel passenger
pencil picture pillow pilot planet plant pocket poem printer problem program project
puzzle question rabbit railway recipe record river rocket saddle sailor scholar school scientist
season secret shadow shelf signal silver singer sister skill soldier spirit stadium startup station
statue story student studio subway summer sunset surface teacher telescope theory ticket tower
tractor traveler treasure tunnel umbrella valley village violin volcano wallet window winter
wizard workshop writer
""".split())

ADJECTIVES: tuple[str, ...] = tuple("""
abrupt absurd ancient angry anxious awkward bashful bitter bold brave breezy bright brisk bumpy
calm careful cheerful chilly clever clumsy cozy crisp curious daring dazzling delicate dusty eager
early elegant empty endless fancy fierce flat fluffy foggy fragile frantic friendly frosty fuzzy
gentle giant gloomy golden graceful greedy grumpy handsome happy hasty healthy heavy hollow honest
humble hungry icy idle jolly juicy keen kind lazy little lively lonely loud lucky massive mellow
messy mighty modern narrow nervous noisy odd orange patient plain polite proud puzzled quick quiet
rapid rare rich rough round rusty sandy savage scary shiny short silent silly sleepy slow smooth
soft sour sparkling spicy steady sticky stormy strange strict sturdy sunny swift tall tame tender
thirsty tidy tiny tired tough tricky ugly vast vivid warm wary weary wild windy wise witty wooden
young zealous
""".split())

VERBS: tuple[str, ...] = tuple("""
accept adjust admire analyze answer arrange assemble avoid balance borrow build calculate carry
change check choose clean collect compare complete consider copy cover create deliver describe
design discover divide double enjoy examine explain explore finish fix follow gather guide handle
harvest ignore imagine improve inspect invent join judge launch lift manage measure mend move notice
observe open organize paint plan polish predict prepare protect question reach rebuild record
reduce release remember repair replace rescue review rewrite sell shape share simplify solve sort
study support test trace translate trust understand update visit watch weigh
""".split())

ADVERBS: tuple[str, ...] = tuple("""
quietly slowly quickly carefully eagerly gently boldly rarely often suddenly gradually patiently
calmly honestly openly roughly simply steadily barely easily happily loudly nearly proudly swiftly
""".split())

# Two-hop entities: disjoint from the haystack vocabulary above.
NAMES: tuple[str, ...] = tuple("""
Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Liam Maria Noah Olivia Peter Quinn
Rachel Samuel Tina Umar Victor Wendy Xavier Yara Zoe Adrian Bella Carlos Diana Ethan Fiona George
Hannah Isaac Julia Kevin Laura Martin Nina Oscar Paula Ryan Sofia Thomas Ursula Vincent William
""".split())

CITIES: tuple[str, ...] = tuple("""
London Paris Berlin Madrid Rome Vienna Prague Lisbon Dublin Oslo Stockholm Helsinki Warsaw Budapest
Athens Istanbul Cairo Nairobi Lagos Mumbai Delhi Bangkok Singapore Jakarta Manila Seoul Tokyo Osaka
Beijing Shanghai Sydney Melbourne Auckland Toronto Montreal Vancouver Chicago Boston Denver Seattle
Houston Miami Lima Bogota Santiago Quito Havana Reykjavik Edinburgh Zurich Geneva Brussels Amsterdam
""".split())

DAYS: tuple[str, ...] = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")

# RULER's "noise" haystack (niah_single_1 / variable tracking).
REPEAT_NOISE: tuple[str, ...] = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
)
