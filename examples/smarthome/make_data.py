"""Write the smart-home tool-call dataset: train.jsonl and test.jsonl beside this file.

Each row is a chat (`messages`): a one-line system prompt naming the fictional "Hearth" home API,
a user request in plain words, and the assistant's answer, which is exactly one JSON tool call
`{"tool": NAME, "arguments": {...}}` with the API's own names and units (rooms in snake_case,
temperatures in °C as numbers, durations in seconds). SmolLM2-135M-Instruct has never seen this API,
so before fine-tuning it answers in prose or with made-up JSON; exact match measures whether it
learnt the schema. Deterministic: the same seed writes the same files.

It also writes the preference pairs of the demo's second stage into `../smarthome-preference/`: for
every request of train and test, the right call chosen and the call with one typical mistake rejected
(`MISTAKES`: a duration left in minutes, a room as spoken instead of its id, ...), as TRL's
conversational prompt / chosen / rejected rows. Its test pairs are the same 50 held-out requests.

    python examples/smarthome/make_data.py [--train 400] [--test 50] [--seed 0] [--out DIR] [--preference-out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = "You control the Hearth smart home. Reply with one JSON tool call and nothing else."

ROOMS = {"kitchen": "kitchen", "living room": "living_room", "bedroom": "bedroom", "office": "office",
         "bathroom": "bathroom", "garage": "garage", "hallway": "hallway", "kids' room": "kids_room"}
ARTISTS = ["Miles Davis", "Adele", "Daft Punk", "Nina Simone", "The Beatles", "Taylor Swift", "Bach",
           "Radiohead", "Fela Kuti", "Bjork"]
ITEMS = ["milk", "eggs", "bread", "coffee", "apples", "rice", "butter", "tomatoes", "dish soap", "cheese"]
LISTS = {"shopping list": "shopping", "hardware list": "hardware"}


def lights(rng: random.Random) -> tuple[str, dict]:
    room = rng.choice(list(ROOMS))
    on = rng.random() < 0.5
    word = "on" if on else "off"
    text = rng.choice([f"Turn {word} the lights in the {room}.", f"Switch the {room} lights {word}.",
                       f"Can you turn the {room} lights {word}?", f"{room.capitalize()} lights {word}, please."])
    return text, {"tool": "set_lights", "arguments": {"room": ROOMS[room], "on": on}}


def dim(rng: random.Random) -> tuple[str, dict]:
    room = rng.choice(list(ROOMS))
    level = rng.choice(range(10, 100, 5))
    text = rng.choice([f"Dim the {room} lights to {level}%.", f"Set the {room} brightness to {level} percent.",
                       f"Make the lights in the {room} {level}% bright."])
    return text, {"tool": "set_brightness", "arguments": {"room": ROOMS[room], "percent": level}}


def thermostat(rng: random.Random) -> tuple[str, dict]:
    room = rng.choice(list(ROOMS))
    celsius = rng.choice(range(16, 27))
    text = rng.choice([f"Set the {room} to {celsius} degrees.", f"Heat the {room} to {celsius}°C.",
                       f"I want the {room} at {celsius} degrees Celsius.", f"Make it {celsius} degrees in the {room}."])
    return text, {"tool": "set_temperature", "arguments": {"room": ROOMS[room], "celsius": celsius}}


def timer(rng: random.Random) -> tuple[str, dict]:
    minutes = rng.choice([1, 2, 3, 5, 8, 10, 12, 15, 20, 25, 30, 45, 60])
    label = rng.choice(["pasta", "tea", "laundry", "oven", "nap", "eggs", "bread"])
    unit = "minute" if minutes == 1 else "minutes"
    text = rng.choice([f"Set a {minutes} {unit} timer for the {label}.", f"Timer for {label}, {minutes} {unit}.",
                       f"Remind me about the {label} in {minutes} {unit}."])
    return text, {"tool": "start_timer", "arguments": {"seconds": minutes * 60, "label": label}}


def music(rng: random.Random) -> tuple[str, dict]:
    room = rng.choice(list(ROOMS))
    artist = rng.choice(ARTISTS)
    text = rng.choice([f"Play {artist} in the {room}.", f"Put on some {artist} in the {room}.",
                       f"I'd like to hear {artist} in the {room}."])
    return text, {"tool": "play_music", "arguments": {"artist": artist, "room": ROOMS[room]}}


def shopping(rng: random.Random) -> tuple[str, dict]:
    item = rng.choice(ITEMS)
    name = rng.choice(list(LISTS))
    text = rng.choice([f"Add {item} to the {name}.", f"Put {item} on my {name}.", f"We need {item}, add it to the {name}."])
    return text, {"tool": "add_to_list", "arguments": {"list": LISTS[name], "item": item}}


TASKS = (lights, dim, thermostat, timer, music, shopping)


def spoken_room(room: str) -> str:
    """A room as the user says it, not the API's id: "living room" for living_room, "Kitchen" for kitchen."""
    spoken = {value: key for key, value in ROOMS.items()}[room]
    return spoken if spoken != room else spoken.capitalize()


# tool → the call with its typical mistake: the API's units and names not followed
MISTAKES = {
    "start_timer": lambda a: {**a, "seconds": a["seconds"] // 60},  # minutes, not converted to seconds
    "set_lights": lambda a: {**a, "room": spoken_room(a["room"])},
    "set_brightness": lambda a: {**a, "percent": a["percent"] / 100},  # a fraction, not percent
    "set_temperature": lambda a: {**a, "celsius": round(a["celsius"] * 9 / 5 + 32)},  # Fahrenheit
    "play_music": lambda a: {**a, "room": spoken_room(a["room"])},
    "add_to_list": lambda a: {**a, "list": {v: k for k, v in LISTS.items()}[a["list"]]},  # "shopping list"
}


def preference_row(row: dict) -> dict:
    """A chat row as a preference pair: its answer chosen, the answer with the tool's typical mistake rejected."""
    *prompt, answer = row["messages"]
    call = json.loads(answer["content"])
    wrong = {"tool": call["tool"], "arguments": MISTAKES[call["tool"]](call["arguments"])}
    return {"prompt": prompt, "chosen": [answer], "rejected": [{"role": "assistant", "content": json.dumps(wrong)}]}


def make_rows(count: int, rng: random.Random, exclude: set[str]) -> list[dict]:
    """`count` rows with distinct requests, none of them in `exclude` (which grows with them)."""
    rows = []
    while len(rows) < count:
        request, call = rng.choice(TASKS)(rng)
        if request in exclude:
            continue
        exclude.add(request)
        rows.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": request},
                                  {"role": "assistant", "content": json.dumps(call)}]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--test", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="folder to write (default: beside this file)")
    parser.add_argument("--preference-out", type=Path, default=Path(__file__).parent.with_name("smarthome-preference"),
                        help="folder for the preference pairs (default: ../smarthome-preference)")
    args = parser.parse_args()
    rng, seen = random.Random(args.seed), set()
    test = make_rows(args.test, rng, seen)  # held out first: no test request is ever a train request
    train = make_rows(args.train, rng, seen)
    args.out.mkdir(parents=True, exist_ok=True)
    args.preference_out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{args.out / name}.jsonl: {len(rows)} rows")
        pairs = [preference_row(row) for row in rows]
        (args.preference_out / f"{name}.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
        print(f"{args.preference_out / name}.jsonl: {len(pairs)} pairs")


if __name__ == "__main__":
    main()
