"""Captioned clips of moving shapes: the data a video scene model learns from, and the detector that
scores what a model drew against its prompt, motion included.

A one-object clip is one shape of one colour (the image scenes' palette, sdquant.quality.scenes)
crossing a plain background in one of four directions at one of two speeds, its caption "a red
circle moving slowly from left to right, white background". A two-object clip holds two shapes of
different colours in two lanes, each with its own direction along its lane: lanes at the top and
the bottom move sideways, lanes on the left and the right move up or down ("a red circle at the top
moving from left to right and a blue square at the bottom moving from right to left, white
background"). Some colour/shape/direction combinations and some two-object direction pairs are
held out of training, to test whether a model composes what it has only seen apart.

The detector has no learned parameters: each frame is read by the image scenes' detector (region,
shape from its fill and centroid, colour as the nearest palette colour in CIELAB), objects are
followed from frame to frame by colour and nearness, and the direction and speed are the sign and
length of the track's displacement. A temporal figure says what per-frame scores cannot: whether
each object keeps its colour and shape from frame to frame (identity), how far its track strays
from a straight line (jitter, pixels), and how much the background flickers between frames.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np

from .scenes import (BACKGROUNDS, COLOURS, IMAGE_SIZE, SHAPES, SIZES, detect_objects, seeded_draw, seeded_pick,
                     shape_mask)

# 4k + 1 frames, as the Wan VAE takes them (a first frame, then 4 a latent frame).
FRAMES = 9
DIRECTIONS = {"from left to right": (1, 0), "from right to left": (-1, 0), "from top to bottom": (0, 1),
              "from bottom to top": (0, -1)}
# How far the shape's centre travels over the clip, in pixels.
SPEEDS = {"slowly": 16, "quickly": 32}
# A one-object clip's shape is small enough to cross the frame at the fast speed and stay whole.
CLIP_SIZE = "small"
# Two-object lanes: where each lane runs (the coordinate across the motion) and which directions it takes.
LANES = {"top": ("y", 18), "bottom": ("y", 46), "left": ("x", 18), "right": ("x", 46)}
LANE_PAIRS = (("top", "bottom"), ("left", "right"))
LANE_PHRASES = {"top": "at the top", "bottom": "at the bottom", "left": "on the left", "right": "on the right"}
HELD_OUT_COUNT = 12
HELD_OUT_PAIRS = 4
HELD_OUT_SEED = 2027
# Training clips start up to this many pixels off their nominal path.
PATH_JITTER = 2
# What a one-object prompt that says no speed reports as its unknown speed.
NO_SPEED = "(none)"
# What score() checks, one-object clips all but the lane, two-object clips all but the speed.
ATTRIBUTES = ("shape", "colour", "direction", "speed", "lane", "background")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _sideways(direction: str) -> bool:
    return DIRECTIONS[direction][1] == 0


@dataclass(frozen=True)
class Clip:
    shape: str
    colour: str
    direction: str
    speed: str
    background: str

    objects = 1

    def caption(self) -> str:
        return f"{_article(self.colour)} {self.colour} {self.shape} moving {self.speed} {self.direction}, " \
               f"{self.background} background"

    def paths(self) -> list[tuple[str, str, tuple[float, float], tuple[float, float]]]:
        """(shape, colour, start centre, end centre) of each object, in pixels."""
        return [(self.shape, self.colour, *_path(self.direction, SPEEDS[self.speed], IMAGE_SIZE / 2))]


@dataclass(frozen=True)
class Mover:
    """One object of a two-object clip: its lane and its direction along it."""

    shape: str
    colour: str
    lane: str
    direction: str

    def phrase(self) -> str:
        return f"{_article(self.colour)} {self.colour} {self.shape} {LANE_PHRASES[self.lane]} moving {self.direction}"


@dataclass(frozen=True)
class TwoObjectClip:
    first: Mover
    second: Mover
    background: str

    objects = 2

    def caption(self) -> str:
        return f"{self.first.phrase()} and {self.second.phrase()}, {self.background} background"

    def paths(self) -> list[tuple[str, str, tuple[float, float], tuple[float, float]]]:
        return [(mover.shape, mover.colour, *_path(mover.direction, SPEEDS["quickly"], LANES[mover.lane][1]))
                for mover in (self.first, self.second)]


def _path(direction: str, travel: float, across: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """Start and end centre of a shape moving `travel` pixels in `direction`, centred on the frame,
    `across` pixels into it on the other axis."""
    dx, dy = DIRECTIONS[direction]
    middle = IMAGE_SIZE / 2
    if dy == 0:
        return (middle - dx * travel / 2, across), (middle + dx * travel / 2, across)
    return (across, middle - dy * travel / 2), (across, middle + dy * travel / 2)


def _lane_directions(lane: str) -> list[str]:
    sideways = LANES[lane][0] == "y"
    return [direction for direction in DIRECTIONS if _sideways(direction) == sideways]


def all_clips(objects: int = 1) -> list[Clip] | list[TwoObjectClip]:
    if objects == 1:
        return [Clip(*values) for values in itertools.product(SHAPES, COLOURS, DIRECTIONS, SPEEDS, BACKGROUNDS)]
    return [TwoObjectClip(Mover(shape_a, colour_a, lane_a, direction_a), Mover(shape_b, colour_b, lane_b, direction_b),
                          background)
            for (colour_a, colour_b), shape_a, shape_b, (lane_a, lane_b), background
            in itertools.product(itertools.permutations(COLOURS, 2), SHAPES, SHAPES, LANE_PAIRS, BACKGROUNDS)
            for direction_a in _lane_directions(lane_a) for direction_b in _lane_directions(lane_b)]


def held_out_combinations() -> set[tuple[str, str, str]]:
    """The (colour, shape, direction) combinations one-object training never sees, fixed by a seed."""
    return seeded_pick(list(itertools.product(COLOURS, SHAPES, DIRECTIONS)), HELD_OUT_COUNT, HELD_OUT_SEED)


def held_out_pairs() -> set[tuple[str, str, str, str]]:
    """The (first colour, first direction, second colour, second direction) of two-object clips
    training never sees, fixed by a seed: it sees each colour with each direction elsewhere."""
    pairs = [(a, direction_a, b, direction_b) for a, b in itertools.permutations(COLOURS, 2)
             for direction_a in DIRECTIONS for direction_b in DIRECTIONS
             if _sideways(direction_a) == _sideways(direction_b)]
    return seeded_pick(pairs, HELD_OUT_PAIRS, HELD_OUT_SEED)


def is_held_out(clip: Clip | TwoObjectClip) -> bool:
    if clip.objects == 2:
        return (clip.first.colour, clip.first.direction, clip.second.colour, clip.second.direction) in held_out_pairs()
    return (clip.colour, clip.shape, clip.direction) in held_out_combinations()


def split(held_out: bool, objects: int = 1) -> list[Clip] | list[TwoObjectClip]:
    return [clip for clip in all_clips(objects) if is_held_out(clip) == held_out]


def sample(count: int, seed: int, held_out: bool = False, objects: int = 1) -> list[Clip] | list[TwoObjectClip]:
    """`count` clips drawn from one split, deterministic by seed; without repeats while they last."""
    return seeded_draw(split(held_out, objects), count, seed)


def render(clips: list[Clip | TwoObjectClip], frames: int = FRAMES, seed: int | None = None) -> np.ndarray:
    """(N, frames, 64, 64, 3) uint8 clips, each shape moving at a constant speed from its start to
    its end. With a seed each path starts a little off its nominal place (training data)."""
    rng = np.random.default_rng(seed) if seed is not None else None
    ys, xs = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE] + 0.5
    videos = np.empty((len(clips), frames, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    half = SIZES[CLIP_SIZE]
    for index, clip in enumerate(clips):
        videos[index] = BACKGROUNDS[clip.background]
        for shape, colour, start, end in clip.paths():
            offset = rng.integers(-PATH_JITTER, PATH_JITTER + 1, size=2) if rng is not None else np.zeros(2)
            for frame, t in enumerate(np.linspace(0.0, 1.0, frames)):
                cx, cy = np.array(start) + t * (np.array(end) - np.array(start)) + offset
                videos[index, frame][shape_mask(shape, xs - cx, ys - cy, half)] = COLOURS[colour]
    return videos


_LANE = r"(at the top|at the bottom|on the left|on the right)"


def parse_caption(prompt: str) -> Clip | TwoObjectClip | dict | None:
    """The clip a prompt asks for; a dict of the words it does not know where it has a clip
    caption's form with a shape, colour, speed, direction or background never captioned (such a
    prompt is scored as missed); None where it is no clip caption at all."""
    text = " ".join(prompt.lower().strip().rstrip(".").split())
    one = re.fullmatch(r"an? (\w+) (\w+) moving ([\w ]+?) ?, ?(\w+) background", text)
    if one is not None:
        colour, shape, motion, background = one.groups()
        first, _, rest = motion.partition(" ")
        speed, direction = (first, rest) if first in SPEEDS else (NO_SPEED, motion)
        unknown = _unknown(colour=[colour], shape=[shape], speed=[speed], direction=[direction],
                           background=[background])
        return unknown or Clip(shape, colour, direction, speed, background)
    two = re.fullmatch(rf"an? (\w+) (\w+) {_LANE} moving ([\w ]+?) and an? (\w+) (\w+) {_LANE} moving ([\w ]+?) ?,"
                       r" ?(\w+) background", text)
    if two is None:
        return None
    colour_a, shape_a, lane_a, direction_a, colour_b, shape_b, lane_b, direction_b, background = two.groups()
    unknown = _unknown(colour=[colour_a, colour_b], shape=[shape_a, shape_b], direction=[direction_a, direction_b],
                       background=[background])
    if unknown:
        return unknown
    movers = sorted([Mover(shape_a, colour_a, _lane(lane_a), direction_a),
                     Mover(shape_b, colour_b, _lane(lane_b), direction_b)], key=lambda m: list(LANES).index(m.lane))
    lanes_fit = (movers[0].lane, movers[1].lane) in LANE_PAIRS and all(
        m.direction in _lane_directions(m.lane) for m in movers)
    if colour_a == colour_b or not lanes_fit:
        return {"lanes": [lane_a, direction_a, lane_b, direction_b]}
    return TwoObjectClip(movers[0], movers[1], background)


def _lane(phrase: str) -> str:
    return phrase.split()[-1]


_VOCABULARY = {"colour": tuple(COLOURS), "shape": SHAPES, "speed": tuple(SPEEDS), "direction": tuple(DIRECTIONS),
               "background": tuple(BACKGROUNDS)}


def _unknown(**words: list[str]) -> dict:
    """{attribute: the words of it never captioned}, empty where every word is known."""
    unknown = {kind: [word for word in said if word not in _VOCABULARY[kind]] for kind, said in words.items()}
    return {kind: said for kind, said in unknown.items() if said}


def caption_vocabulary() -> list[str]:
    """Every clip caption's words, each once: what a video scene model's tokenizer is built from."""
    captions = [clip.caption() for objects in (1, 2) for clip in all_clips(objects)]
    return sorted({word for caption in captions for word in re.findall(r"\w+|,", caption)} | {"an", "."})


@dataclass(frozen=True)
class Track:
    """One object followed through a clip: its colour and shape as most frames read them, its
    centre (x, y) in each frame it was found in (None where it was not), and how many frames read
    another colour or shape for it."""

    colour: str
    shape: str
    centres: tuple
    changed: int

    def displacement(self) -> tuple[float, float]:
        found = [centre for centre in self.centres if centre is not None]
        return (found[-1][0] - found[0][0], found[-1][1] - found[0][1]) if len(found) > 1 else (0.0, 0.0)

    def direction(self) -> str | None:
        """The direction of the track's displacement, None where it moved less than a slow clip's
        half travel."""
        dx, dy = self.displacement()
        if max(abs(dx), abs(dy)) < SPEEDS["slowly"] / 2:
            return None
        return min(DIRECTIONS, key=lambda name: -(DIRECTIONS[name][0] * dx + DIRECTIONS[name][1] * dy))

    def speed(self) -> str:
        travel = max(abs(value) for value in self.displacement())
        return min(SPEEDS, key=lambda name: abs(np.log(max(travel, 1.0) / SPEEDS[name])))

    def jitter(self) -> float:
        """The track's largest distance from the straight line through its first and last centres."""
        found = np.array([centre for centre in self.centres if centre is not None], dtype=np.float64)
        if len(found) < 3:
            return 0.0
        steps = np.linspace(0.0, 1.0, len(found))[:, None]
        line = found[0] + steps * (found[-1] - found[0])
        return float(np.linalg.norm(found - line, axis=1).max())


def tracks(video: np.ndarray, count: int) -> tuple[str | None, list[Track]]:
    """The background and up to `count` objects followed through a (frames, 64, 64, 3) clip in
    [0, 1]: each frame's shapes matched to the tracks by colour, then by nearness."""
    readings = [detect_objects(frame, count) for frame in video]
    backgrounds = [reading[0] for reading in readings if reading is not None]
    frames = [reading[1] if reading is not None else [] for reading in readings]
    first = max(frames, key=len) if frames else []
    seeds = [(found.colour, found.centre) for found in first]
    followed: list[list] = [[] for _ in seeds]
    for found_in_frame in frames:
        left = list(found_in_frame)
        for index, (colour, _) in enumerate(seeds):
            last = next((f.centre for f in reversed(followed[index]) if f is not None), seeds[index][1])
            same = [f for f in left if f.colour == colour] or left
            if not same:
                followed[index].append(None)
                continue
            match = min(same, key=lambda f: (f.centre[0] - last[0]) ** 2 + (f.centre[1] - last[1]) ** 2)
            left.remove(match)
            followed[index].append(match)
    background = max(set(backgrounds), key=backgrounds.count) if backgrounds else None
    return background, [_track(found) for found in followed]


def _track(found: list) -> Track:
    seen = [f for f in found if f is not None]
    colour = max({f.colour for f in seen}, key=[f.colour for f in seen].count)
    shape = max({f.shape for f in seen}, key=[f.shape for f in seen].count)
    changed = sum(f.colour != colour or f.shape != shape for f in seen)
    return Track(colour, shape, tuple(f.centre if f is not None else None for f in found), changed)


def flicker(video: np.ndarray) -> float:
    """The background's mean change from frame to frame (0-255 levels), over the pixels no object
    covers in either frame: zero for a steady background, whatever moves across it. Between two
    frames with no background pixel in common, the whole frame's change counts."""
    levels = video.astype(np.float64) * 255
    background = np.median(np.concatenate([levels[:, 0], levels[:, -1], levels[:, :, 0], levels[:, :, -1]], axis=1),
                           axis=1)
    still = np.linalg.norm(levels - background[:, None, None], axis=-1) < 20
    # Where no pixel keeps the background in both frames, the whole frame's change is the flicker.
    changes = [np.abs(levels[i + 1] - levels[i])[both if both.any() else slice(None)].mean()
               for i, both in enumerate(still[:-1] & still[1:])]
    return float(np.mean(changes)) if changes else 0.0


def score(video: np.ndarray, prompt: str) -> dict:
    """Per attribute, whether a (frames, 64, 64, 3) clip in [0, 1] shows what the prompt asks, and
    "all"; the temporal figures (identity kept, the tracks' jitter, the background's flicker). A
    clip caption with a word never captioned is scored, as missed; a prompt that is no clip
    caption, or a video of another size, is not scorable."""
    wanted = parse_caption(prompt)
    # The directions, speeds and lanes are read in the renderer's pixels.
    if wanted is None or video.shape[1:3] != (IMAGE_SIZE, IMAGE_SIZE):
        return {"scorable": False}
    count = 1 if isinstance(wanted, Clip) else 2
    background, found = tracks(video, count)
    # Kept where every object asked for is followed through every frame in one colour and shape (a
    # never-captioned prompt: every object found); a clip that draws nothing keeps nothing.
    shown = len(found) == count if not isinstance(wanted, dict) else bool(found)
    temporal = {"identity_kept": shown and all(track.changed == 0 and None not in track.centres for track in found),
                "jitter": max((track.jitter() for track in found), default=0.0), "flicker": flicker(video)}
    if isinstance(wanted, dict):
        return {"scorable": True, "all": False, "never_captioned": wanted, **temporal}
    checks = (_check_one(found, wanted) if isinstance(wanted, Clip) else _check_two(found, wanted))
    checks["background"] = background == wanted.background
    return {**checks, "all": all(checks.values()), "scorable": True, "objects": wanted.objects, **temporal}


def _check_one(found: list[Track], wanted: Clip) -> dict:
    track = found[0] if found else None
    return {"shape": track is not None and track.shape == wanted.shape,
            "colour": track is not None and track.colour == wanted.colour,
            "direction": track is not None and track.direction() == wanted.direction,
            "speed": track is not None and track.speed() == wanted.speed}


def _check_two(found: list[Track], wanted: TwoObjectClip) -> dict:
    """Each wanted object looked for by its colour: its shape, its direction, and its lane."""
    by_colour = {track.colour: track for track in found}
    matched = [(mover, by_colour.get(mover.colour)) for mover in (wanted.first, wanted.second)]
    return {"colour": all(track is not None for _, track in matched),
            "shape": all(track is not None and track.shape == mover.shape for mover, track in matched),
            "direction": all(track is not None and track.direction() == mover.direction for mover, track in matched),
            "lane": all(track is not None and _lane_of(track) == mover.lane for mover, track in matched)}


def _lane_of(track: Track) -> str:
    """The lane a track ran in: the side of the frame its mean centre lies on, across its motion."""
    found = np.array([centre for centre in track.centres if centre is not None], dtype=np.float64)
    x, y = found.mean(axis=0)
    dx, dy = track.displacement()
    if abs(dx) >= abs(dy):
        return "top" if y < IMAGE_SIZE / 2 else "bottom"
    return "left" if x < IMAGE_SIZE / 2 else "right"
