"""The quick start: write a tiny random-weight checkpoint, make a second of input audio, run
the offline duplex loop on it and write the spoken reply.

    python examples/quickstart.py [--model PATH_OR_HUB_ID] [--audio FILE] [--out DIR]

Without ``--model`` it writes a random-weight checkpoint with the package's factory (the same
as ``mlx-voicechat make-checkpoint DIR/tiny --force``), so nothing is downloaded and the
answer is gibberish: the pipeline is the real one. With a hub id (for example
``mlx-community/NemotronLabs-VoiceChat-11B-4bit``) the checkpoint is downloaded into the
Hugging Face cache first; a local folder never touches the network. ``--audio`` takes your own
question (any rate, mono or stereo); without it the input is one second of quiet noise.

Everything goes into ``DIR`` (default: ``mlx-voicechat-quickstart`` in the system's temporary
folder): ``tiny/``, ``question.wav`` and ``reply.wav``, each replacing the one an earlier run
wrote. ``DIR`` must be new, empty, or a folder this script wrote: nothing else is replaced.
The last step is ``mlx-voicechat generate``, printed before it runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile

from mlx_voicechat import cli
from mlx_voicechat.errors import VoiceChatError
from mlx_voicechat.factory import make_checkpoint

INPUT_RATE = 16000  # the model listens at 16 kHz
PARTIAL = ".question.wav.partial"
OURS = {"tiny", "question.wav", "reply.wav", PARTIAL}  # what this script writes into its folder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder or hub id (default: a tiny random one)")
    p.add_argument("--audio", help="the question (default: one second of quiet noise)")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "mlx-voicechat-quickstart"))
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        model, audio = prepare(out, args.model, args.audio)
    except (VoiceChatError, OSError) as e:
        print(f"quickstart: error: {e}", file=sys.stderr)
        return 2

    command = ["generate", "--model", model, "--audio", audio,
               "--output-audio", str(out / "reply.wav"), "-p", "Be concise.", "--seed", "0"]
    print("$ mlx-voicechat " + " ".join(shlex.quote(c) for c in command), flush=True)
    return cli.main(command)


def prepare(out: Path, model, audio):
    """The checkpoint and the question to run on: the ones given, or new ones in ``out``."""
    if out.exists() and not out.is_dir():
        raise VoiceChatError(f"--out {out} is not a folder")
    others = sorted(e.name for e in out.iterdir() if e.name not in OURS) if out.exists() else []
    if others:
        raise VoiceChatError(
            f"--out {out} holds files this script did not write ({', '.join(others[:3])}); "
            "pass a new or empty folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = str(make_checkpoint(out / "tiny", scale="tiny", seed=0, force=True))
        print(f"wrote a tiny random-weight checkpoint to {model}")
    if audio is None:
        audio = str(out / "question.wav")
        noise = 0.1 * np.random.default_rng(0).standard_normal(INPUT_RATE)
        partial = out / PARTIAL  # renamed onto our own file only once it is whole
        soundfile.write(partial, noise.astype(np.float32), INPUT_RATE, subtype="PCM_16", format="WAV")
        os.replace(partial, audio)
        print(f"wrote 1.00 s of input audio to {audio}")
    return model, audio


if __name__ == "__main__":
    sys.exit(main())
