#!/usr/bin/env python3
"""Makes the bad model directories the CLI tests feed qflash (standard library only).

  edit_model.py config DIR KEY JSON     set config.json's KEY to a JSON value ('null', '"x"', ...)
  edit_model.py nest FILE KEY DEPTH     set KEY of the JSON object in FILE to DEPTH nested lists
  edit_model.py poison DIR TENSOR VALUE write VALUE (nan, inf) over the first element of an F32
                                        tensor of DIR/model.safetensors
  edit_model.py add-token DIR ID        give DIR/tokenizer.json an added token with id ID
"""
import json
import struct
import sys
from pathlib import Path


def load(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def save(path, obj):
    Path(path).write_text(json.dumps(obj, indent=1), encoding="utf-8")


def main(argv):
    cmd = argv[1]
    if cmd == "config":
        path = Path(argv[2]) / "config.json"
        cfg = load(path)
        cfg[argv[3]] = json.loads(argv[4])
        save(path, cfg)
    elif cmd == "nest":
        depth = int(argv[4])
        obj = load(argv[2])
        # Written by hand: json.dumps recurses and would stop far short of the depth wanted.
        value = "[" * depth + "]" * depth
        obj[argv[3]] = None
        text = json.dumps(obj).replace(json.dumps(argv[3]) + ": null", json.dumps(argv[3]) + ": " + value)
        Path(argv[2]).write_text(text, encoding="utf-8")
    elif cmd == "poison":
        path = Path(argv[2]) / "model.safetensors"
        data = bytearray(path.read_bytes())
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        t = header[argv[3]]
        assert t["dtype"] == "F32", t["dtype"]
        begin = 8 + n + t["data_offsets"][0]
        data[begin:begin + 4] = struct.pack("<f", float(argv[4]))
        path.write_bytes(bytes(data))
    elif cmd == "add-token":
        path = Path(argv[2]) / "tokenizer.json"
        tok = load(path)
        tok["added_tokens"].append({"id": int(argv[3]), "content": "<|extra|>", "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": True})
        save(path, tok)
    else:
        sys.exit(f"edit_model.py: unknown command {cmd}")


if __name__ == "__main__":
    main(sys.argv)
