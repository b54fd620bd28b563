"""Captioned scenes: the data the built-in scene models learn from, and the detector that scores
what a model drew against its prompt.

A one-object scene is one shape (circle, square, triangle) of one of six colours, at one of five
places and two sizes, on one of four background colours, drawn with crisp edges at 64x64 pixels,
with its caption ("a small red circle on the left, white background"). 64x64 keeps a 16x16 latent
under a factor-4 VAE, so a model trains in minutes on one GPU and draws an image in well under a
second on a CPU, while the smallest shape still spans 18 pixels, enough for its kind to survive
the VAE. Twelve colour/shape/position combinations are held out of training, to test whether a
model composes attributes it has only seen apart.

A two-object scene holds two small shapes of different colours, one on the left and one on the
right or one at the top and one at the bottom ("a red circle on the left and a blue square on the
right, white background"): the prompt binds each colour and shape to its own place, where GenEval
(Ghosh et al., 2023) found real models fail first. Six ordered colour pairs are held out: training
sees each of them only swapped (blue on the left and red on the right, never the reverse).

The detector uses scikit-image: the background is the border's median colour, a shape a connected
region that differs from it, its kind read from the region's centroid and the fill ratio of its
bounding box, its colour the nearest palette colour in CIELAB.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass

import numpy as np

IMAGE_SIZE = 64
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 230),
           "yellow": (240, 215, 40), "purple": (150, 60, 200), "orange": (250, 140, 30)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128),
               "pink": (245, 175, 205)}
# Centre of the shape, as (x, y) in pixels of a 64x64 image.
POSITIONS = {"left": (18, 32), "right": (46, 32), "top": (32, 18), "bottom": (32, 46), "centre": (32, 32)}
# Half the side of the shape's bounding box, in pixels.
SIZES = {"small": 9, "large": 14}
POSITION_PHRASES = {"left": "on the left", "right": "on the right", "top": "at the top",
                    "bottom": "at the bottom", "centre": "in the centre"}
ATTRIBUTES = ("shape", "colour", "position", "size", "background")
HELD_OUT_COUNT = 12
HELD_OUT_SEED = 2026
# Two-object scenes: the places of the first and second object, their size, and how many ordered
# colour pairs training sees only swapped.
PLACEMENTS = (("left", "right"), ("top", "bottom"))
TWO_OBJECT_SIZE = "small"
HELD_OUT_COLOUR_ORDERS = 6
# Regions smaller than this many pixels are specks, not shapes (the smallest shape covers 100).
MIN_OBJECT_AREA = 30
# Training scenes move by up to this many pixels and grow or shrink by up to one.
POSITION_JITTER = 2
SIZE_JITTER = 1


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    position: str
    size: str
    background: str

    objects = 1

    def caption(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} {POSITION_PHRASES[self.position]}, {self.background} background"

    def drawn(self) -> list[tuple[str, str, str, str]]:
        """(shape, colour, position, size) of each shape to draw."""
        return [(self.shape, self.colour, self.position, self.size)]


@dataclass(frozen=True)
class Placed:
    """One object of a two-object scene."""

    shape: str
    colour: str
    position: str

    def phrase(self) -> str:
        article = "an" if self.colour[0] in "aeiou" else "a"
        return f"{article} {self.colour} {self.shape} {POSITION_PHRASES[self.position]}"


@dataclass(frozen=True)
class TwoObjectScene:
    """Two shapes of different colours, the first on the left (or at the top), the second on the
    right (or at the bottom)."""

    first: Placed
    second: Placed
    background: str
    objects = 2

    def caption(self) -> str:
        return f"{self.first.phrase()} and {self.second.phrase()}, {self.background} background"

    def drawn(self) -> list[tuple[str, str, str, str]]:
        return [(thing.shape, thing.colour, thing.position, TWO_OBJECT_SIZE) for thing in (self.first, self.second)]


def all_scenes(objects: int = 1) -> list[Scene] | list[TwoObjectScene]:
    if objects == 1:
        return [Scene(*values) for values in itertools.product(SHAPES, COLOURS, POSITIONS, SIZES, BACKGROUNDS)]
    return [TwoObjectScene(Placed(shape_a, colour_a, place_a), Placed(shape_b, colour_b, place_b), background)
            for (colour_a, colour_b), shape_a, shape_b, (place_a, place_b), background
            in itertools.product(itertools.permutations(COLOURS, 2), SHAPES, SHAPES, PLACEMENTS, BACKGROUNDS)]


def seeded_pick(items: list, count: int, seed: int) -> set:
    """`count` of `items`, picked without repeats, fixed by a seed."""
    picked = np.random.default_rng(seed).choice(len(items), count, replace=False)
    return {items[i] for i in sorted(picked)}


def seeded_draw(pool: list, count: int, seed: int) -> list:
    """`count` of `pool` in an order fixed by a seed, without repeats while they last."""
    rng = np.random.default_rng(seed)
    order = [i for _ in range(-(-count // len(pool))) for i in rng.permutation(len(pool))]
    return [pool[i] for i in order[:count]]


def held_out_combinations() -> set[tuple[str, str, str]]:
    """The (colour, shape, position) combinations training never sees, fixed by a seed."""
    return seeded_pick(list(itertools.product(COLOURS, SHAPES, POSITIONS)), HELD_OUT_COUNT, HELD_OUT_SEED)


def held_out_colour_orders() -> set[tuple[str, str]]:
    """The (first, second) colour orders of two-object scenes that training never sees; it sees
    each of them swapped. Fixed by a seed."""
    rng = np.random.default_rng(HELD_OUT_SEED)
    pairs = list(itertools.combinations(COLOURS, 2))
    picked = rng.choice(len(pairs), HELD_OUT_COLOUR_ORDERS, replace=False)
    return {pairs[i] if rng.integers(2) else pairs[i][::-1] for i in sorted(picked)}


def is_held_out(scene: Scene | TwoObjectScene) -> bool:
    if scene.objects == 2:
        return (scene.first.colour, scene.second.colour) in held_out_colour_orders()
    return (scene.colour, scene.shape, scene.position) in held_out_combinations()


def split(held_out: bool, objects: int = 1) -> list[Scene] | list[TwoObjectScene]:
    """Every scene of the training split, or of the held-out one."""
    return [scene for scene in all_scenes(objects) if is_held_out(scene) == held_out]


def sample(count: int, seed: int, held_out: bool = False, objects: int = 1) -> list[Scene] | list[TwoObjectScene]:
    """`count` scenes drawn from one split, deterministic by seed; without repeats while they last."""
    return seeded_draw(split(held_out, objects), count, seed)


def render(scenes: list[Scene | TwoObjectScene], seed: int | None = None) -> np.ndarray:
    """(N, 64, 64, 3) uint8 images. With a seed each shape moves and resizes a little (training
    data); without one every shape sits exactly at its nominal place and size."""
    rng = np.random.default_rng(seed) if seed is not None else None
    ys, xs = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE] + 0.5
    images = np.empty((len(scenes), IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for index, scene in enumerate(scenes):
        images[index] = BACKGROUNDS[scene.background]
        for shape, colour, position, size in scene.drawn():
            cx, cy = POSITIONS[position]
            half = SIZES[size]
            if rng is not None:
                cx, cy = np.array([cx, cy]) + rng.integers(-POSITION_JITTER, POSITION_JITTER + 1, size=2)
                half += int(rng.integers(-SIZE_JITTER, SIZE_JITTER + 1))
            images[index][shape_mask(shape, xs - cx, ys - cy, half)] = COLOURS[colour]
    return images


def shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray, half: float) -> np.ndarray:
    if shape == "circle":
        return dx ** 2 + dy ** 2 <= half ** 2
    if shape == "square":
        return (np.abs(dx) <= half) & (np.abs(dy) <= half)
    # An upright isosceles triangle filling the same box: apex at the top, base at the bottom.
    return (dy <= half) & (np.abs(dx) <= (dy + half) / 2)


_WORDS = {
    "shape": SHAPES, "colour": tuple(COLOURS), "size": tuple(SIZES), "background": tuple(BACKGROUNDS),
}
_PLACE = r"(on the left|on the right|at the top|at the bottom|in the centre|in the center)"


def _position(place: str) -> str:
    return place.split()[-1].replace("center", "centre")


def _known(*words: tuple[str, str]) -> bool:
    """Whether each (kind, word) names a known shape, colour, size or background."""
    return all(word in _WORDS[kind] for kind, word in words)


def parse_caption(prompt: str) -> Scene | TwoObjectScene | None:
    """The scene a prompt asks for, or None when it is not a scene caption this detector can score
    (an unknown word where a shape, colour, size, place or background should be, two objects at
    places that are not a left/right or top/bottom pair, or of one colour)."""
    text = prompt.lower()
    one = re.fullmatch(rf"\s*an?\s+(\w+)\s+(\w+)\s+(\w+)\s+{_PLACE}\s*,\s*(\w+)\s+background\s*\.?\s*", text)
    if one is not None:
        size, colour, shape, place, background = one.groups()
        known = _known(("shape", shape), ("colour", colour), ("size", size), ("background", background))
        return Scene(shape, colour, _position(place), size, background) if known else None
    two = re.fullmatch(rf"\s*an?\s+(\w+)\s+(\w+)\s+{_PLACE}\s+and\s+an?\s+(\w+)\s+(\w+)\s+{_PLACE}\s*,"
                       rf"\s*(\w+)\s+background\s*\.?\s*", text)
    if two is None:
        return None
    colour_a, shape_a, place_a, colour_b, shape_b, place_b, background = two.groups()
    known = _known(("colour", colour_a), ("shape", shape_a), ("colour", colour_b), ("shape", shape_b),
                   ("background", background))
    things = sorted([Placed(shape_a, colour_a, _position(place_a)), Placed(shape_b, colour_b, _position(place_b))],
                    key=lambda thing: POSITIONS[thing.position])
    if not known or colour_a == colour_b or (things[0].position, things[1].position) not in PLACEMENTS:
        return None
    return TwoObjectScene(things[0], things[1], background)


def caption_vocabulary() -> list[str]:
    """Every caption's words, each once: what the scene models' tokenizers are built from."""
    captions = [scene.caption() for objects in (1, 2) for scene in all_scenes(objects)]
    return sorted({word for caption in captions for word in re.findall(r"\w+|,", caption)} | {"center", "an", "."})


def _nearest(colour_lab: np.ndarray, palette: dict[str, tuple[int, int, int]]) -> str:
    from skimage.color import deltaE_ciede2000, rgb2lab

    names = list(palette)
    palette_lab = rgb2lab(np.array([palette[name] for name in names], dtype=np.float64)[None] / 255)[0]
    return names[int(np.argmin(deltaE_ciede2000(palette_lab, colour_lab[None].repeat(len(names), 0))))]


@dataclass(frozen=True)
class Found:
    """A shape the detector read: its kind, colour, the centre of its box (x, y) and half its side."""

    shape: str
    colour: str
    centre: tuple[float, float]
    half: float

    def position(self) -> str:
        x, y = self.centre
        return min(POSITIONS, key=lambda name: (POSITIONS[name][0] - x) ** 2 + (POSITIONS[name][1] - y) ** 2)


def _background(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The image in CIELAB, the border's median colour, and every pixel's distance from it."""
    from skimage.color import rgb2lab

    lab = rgb2lab(np.clip(image, 0, 1))
    border = np.concatenate([lab[0], lab[-1], lab[1:-1, 0], lab[1:-1, -1]])
    background_lab = np.median(border, axis=0)
    return lab, background_lab, np.linalg.norm(lab - background_lab, axis=-1)


def _read_shape(lab: np.ndarray, background_lab: np.ndarray, distance: np.ndarray, window: np.ndarray) -> Found | None:
    """The largest shape inside `window` (a boolean mask of the image)."""
    from skimage.filters import gaussian
    from skimage.measure import label, regionprops
    from skimage.morphology import erosion

    # Project every pixel on the line from the background to the shape's colour: the midpoint of
    # a blurred edge stays where the crisp edge was, so the region keeps its true extent.
    core = window & (distance > 0.75 * distance[window].max())
    shape_lab = np.median(lab[core], axis=0)
    direction = shape_lab - background_lab
    towards_shape = (lab - background_lab) @ direction / (direction @ direction)
    # A light blur keeps pixel noise from punching holes into the region or specks around it.
    regions = regionprops(label((gaussian(towards_shape, sigma=0.7) > 0.5) & window))
    if not regions:
        return None
    region = max(regions, key=lambda r: r.area)
    inner = erosion(region.image) if region.image.sum() > 20 else region.image
    min_row, min_col, max_row, max_col = region.bbox
    colour_lab = np.median(lab[min_row:max_row, min_col:max_col][inner], axis=0)
    # The box's centre, not the centroid: a triangle's centroid sits a sixth of its box lower.
    half = max(max_row - min_row, max_col - min_col) / 2
    # Centroids count from pixel centres, boxes from pixel edges.
    lower_by = (region.centroid[0] + 0.5 - (min_row + max_row) / 2) / half
    return Found(_shape_kind(region.extent, lower_by), _nearest(colour_lab, COLOURS),
                 ((min_col + max_col) / 2, (min_row + max_row) / 2), half)


def detect(image: np.ndarray) -> Scene | None:
    """The one-object scene in a (64, 64, 3) image with values in [0, 1], or None when no shape
    stands out from the background."""
    lab, background_lab, distance = _background(image)
    if distance.max() < 10:
        return None
    found = _read_shape(lab, background_lab, distance, np.ones(distance.shape, dtype=bool))
    if found is None:
        return None
    return Scene(shape=found.shape, colour=found.colour, position=found.position(),
                 size=min(SIZES, key=lambda name: abs(np.log(found.half / SIZES[name]))),
                 background=_nearest(background_lab, BACKGROUNDS))


def _least_contrast() -> float:
    """The smallest CIELAB distance between a shape's colour and a background's."""
    from skimage.color import rgb2lab

    def lab(palette):
        return rgb2lab(np.array(list(palette.values()), dtype=np.float64)[None] / 255)[0]

    return float(np.linalg.norm(lab(COLOURS)[:, None] - lab(BACKGROUNDS)[None], axis=-1).min())


def detect_objects(image: np.ndarray, count: int = 2) -> tuple[str, list[Found]] | None:
    """The background and up to `count` shapes (the largest regions that stand apart from it), each
    read within its own neighbourhood so that the other's colour never enters it; None when no
    shape stands out."""
    from skimage.filters import gaussian
    from skimage.measure import label, regionprops
    from skimage.morphology import dilation, disk

    lab, background_lab, distance = _background(image)
    # Half the weakest palette contrast: below every shape's edge midpoint, above pixel noise.
    regions = regionprops(label(gaussian(distance, sigma=0.7) > 0.5 * _least_contrast()))
    regions = sorted((r for r in regions if r.area >= MIN_OBJECT_AREA), key=lambda r: r.area, reverse=True)
    if not regions:
        return None
    found = []
    for region in regions[:count]:
        mask = np.zeros(distance.shape, dtype=bool)
        mask[tuple(region.coords.T)] = True
        shape = _read_shape(lab, background_lab, distance, dilation(mask, disk(2)))
        if shape is not None:
            found.append(shape)
    return _nearest(background_lab, BACKGROUNDS), found


def detect_two(image: np.ndarray) -> TwoObjectScene | None:
    """The two-object scene in an image, or None when it does not hold two shapes at a left/right
    or top/bottom pair of places."""
    read = detect_objects(image, 2)
    if read is None or len(read[1]) < 2:
        return None
    background, found = read
    things = sorted((Placed(f.shape, f.colour, f.position()) for f in found), key=lambda t: POSITIONS[t.position])
    if (things[0].position, things[1].position) not in PLACEMENTS:
        return None
    return TwoObjectScene(things[0], things[1], background)


def _shape_kind(extent: float, lower_by: float) -> str:
    """An upright triangle's centroid lies a third of its half-height below its box's centre;
    a circle's and a square's on it. Circle and square differ in how much of the box they fill
    (pi/4 against 1). Both measures survive a blur that rounds corners."""
    if lower_by > 0.12:
        return "triangle"
    return "square" if extent > 0.89 else "circle"


def score(image: np.ndarray, prompt: str) -> dict:
    """Per attribute, whether the image shows what the prompt asks, and "all"; or
    {"scorable": False} for a prompt that is not a scene caption. A two-object prompt's shape,
    colour and position are right when both objects' are: each object is looked for at its own
    place, so a red circle drawn where the blue square belongs gets neither right."""
    wanted = parse_caption(prompt)
    if wanted is None:
        return {"scorable": False}
    checks, detected = _check_one(image, wanted) if wanted.objects == 1 else _check_two(image, wanted)
    return {**checks, "all": all(checks.values()), "scorable": True, "objects": wanted.objects, "detected": detected}


def _check_one(image: np.ndarray, wanted: Scene) -> tuple[dict, dict | None]:
    found = detect(image)
    checks = {name: found is not None and getattr(found, name) == getattr(wanted, name) for name in ATTRIBUTES}
    return checks, asdict(found) if found is not None else None


def _check_two(image: np.ndarray, wanted: TwoObjectScene) -> tuple[dict, list[dict]]:
    read = detect_objects(image, 2)
    background, found = read if read is not None else (None, [])
    at_place = {shape.position(): shape for shape in found}
    matched = [(thing, at_place.get(thing.position)) for thing in (wanted.first, wanted.second)]
    checks = {"shape": all(f is not None and f.shape == t.shape for t, f in matched),
              "colour": all(f is not None and f.colour == t.colour for t, f in matched),
              "position": len(found) == 2 and all(f is not None for _, f in matched),
              "background": background == wanted.background}
    return checks, [asdict(shape) for shape in found]
