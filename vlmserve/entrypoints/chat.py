"""`vlmserve chat`: one question, or a conversation in the terminal.

With a QUESTION the answer is streamed and the command exits. Without one, each line read is a
user turn and the conversation's history (images included) goes into every prompt, as a chat
client sends it; lines starting with '/' are commands (/image PATH, /video PATH, /clear, /help,
/exit); end of input (Ctrl-D, or the end of a pipe) quits. With --draw-boxes each answer's boxes
are drawn on the conversation's latest image (Qwen-VL's rule), one PNG per turn.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from vlmserve.arg_types import parallel_options

if TYPE_CHECKING:
    from vlmserve import LLM
    from vlmserve.grounding import GroundingConvention
    from vlmserve.outputs import MultiModalItemInfo

logger = logging.getLogger("vlmserve.chat")

HELP = """commands:
  /image PATH   attach an image (path or URL) to your next message
  /video PATH   attach a video to your next message
  /clear        forget the conversation (the system prompt stays)
  /help         this list
  /exit         quit (so does Ctrl-D)"""


class Chat:
    """A conversation with one model: the messages so far and the media of the next turn."""

    def __init__(self, llm: LLM, args: argparse.Namespace, out: IO[str] = sys.stdout) -> None:
        from vlmserve import SamplingParams

        self.llm = llm
        self.args = args
        self.out = out
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.messages: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []  # content parts for the next user turn
        self.images: list[str] = []  # every image of the conversation, in order
        self.turns = 0
        defaults = llm.get_default_sampling_params()
        self.params = SamplingParams(
            temperature=defaults.temperature if args.temperature is None else args.temperature,
            top_p=defaults.top_p,
            top_k=defaults.top_k,
            min_p=defaults.min_p,
            repetition_penalty=defaults.repetition_penalty
            if args.repetition_penalty is None
            else args.repetition_penalty,
            max_tokens=args.max_tokens,
            seed=args.seed,
            # Qwen2-VL writes boxes with special tokens (<|box_start|>...): kept in the text (the
            # history and --draw-boxes read them), shown readably (grounding.readable).
            skip_special_tokens=False,
        )
        self.convention = _box_convention(llm, args)
        for image in args.image:
            self.attach("image", image)
        for video in args.video:
            self.attach("video", video)

    def attach(self, modality: str, source: str) -> None:
        self.pending.append({"type": modality, modality: source})

    def ask(self, question: str) -> int:
        """One user turn: the answer streamed to `out` and kept in the history. 0, or 1 if its
        boxes could not be drawn. A turn the processor refuses (an image it cannot decode, too
        long a prompt) raises ValueError and is left out of the history."""
        parts = [*self.pending, {"type": "text", "text": question}]
        turn = {"role": "user", "content": parts}
        try:
            prompt = self.llm.process_chat([*self.system, *self.messages, turn])
        finally:
            self.pending = []
        text, mm_items = self._stream(prompt)
        self.turns += 1
        logger.debug("turn %d answer: %r", self.turns, text)
        self.messages += [turn, {"role": "assistant", "content": text}]
        self.images += [part["image"] for part in parts if part["type"] == "image"]
        if self.args.draw_boxes is None:
            return 0
        images = [item for item in mm_items if item.modality == "image"]
        if not images:
            print("(no image in the conversation: no boxes drawn)", file=sys.stderr)
            return 0
        out = self.args.draw_boxes
        if self.args.interactive:  # one PNG per turn: boxes.png -> boxes-1.png, boxes-2.png, ...
            out = out.with_name(f"{out.stem}-{self.turns}{out.suffix}")
        return _draw_boxes(text, self.images[-1], images[-1], self.convention, out, self.out)

    def _stream(self, prompt: Any) -> tuple[str, list[MultiModalItemInfo]]:
        from vlmserve.grounding import readable

        shown = 0
        text = ""
        mm_items: list[MultiModalItemInfo] = []
        for output in self.llm.stream(prompt, self.params):
            text = output.outputs[0].text
            display = readable(text, self.convention.tags)  # grows with the text
            self.out.write(display[shown:])
            self.out.flush()
            shown = len(display)
            mm_items = output.mm_items
        self.out.write(readable(text, self.convention.tags, complete=True)[shown:] + "\n")
        self.out.flush()
        return text, mm_items

    def command(self, line: str) -> bool:
        """A /command; False when it asks to quit."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/image", "/video") and rest:
            problem = check_local_media(rest, name[1:])
            if problem:
                print(f"error: {name} {rest}: {problem}", file=sys.stderr)
            else:
                self.attach(name[1:], rest)
                print(f"({name[1:]} attached to your next message: {rest})", file=sys.stderr)
        elif name == "/clear":
            self.messages, self.pending, self.images = [], [], []
            print("(conversation cleared)", file=sys.stderr)
        elif name == "/help":
            print(HELP, file=sys.stderr)
        else:
            print(f"error: unknown command {line!r}; /help lists them", file=sys.stderr)
        return True

    def loop(self, lines: IO[str]) -> int:
        """Read turns until end of input or /exit."""
        terminal = lines.isatty()
        if terminal:
            import readline  # noqa: F401 (line editing and history for input())

            print("(a conversation: /help lists the commands, Ctrl-D quits)", file=sys.stderr)
        while True:
            try:
                line = input(">>> ") if terminal else lines.readline()
            except EOFError:
                line = ""
            except KeyboardInterrupt:
                print(file=sys.stderr)
                return 0
            if not line:  # end of input
                if terminal:
                    print(file=sys.stderr)
                return 0
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return 0
                continue
            try:
                with typing_held_back(lines):
                    self.ask(line)
            except ValueError as e:  # the turn is left out; the conversation goes on
                print(f"error: {e}", file=sys.stderr)
            except KeyboardInterrupt:
                print("\n(answer interrupted; the turn is left out)", file=sys.stderr)


@contextlib.contextmanager
def typing_held_back(lines: IO[str]) -> Iterator[None]:
    """While an answer streams, what the user types on the terminal is not echoed into it; the
    keystrokes stay in the terminal's input, so they start the next prompt (readline shows them
    there), or reach the shell after a one-shot question. Only the terminal's echo is turned off:
    Ctrl-C still interrupts. Anything but a terminal (a pipe, a file; Windows) is left alone."""
    try:
        import termios

        fd = lines.fileno()
        saved = termios.tcgetattr(fd) if lines.isatty() else None
    except (ImportError, OSError, ValueError):  # no termios, or no file descriptor behind `lines`
        saved = None
    if saved is None:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ECHONL)  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:  # TCSANOW, not TCSAFLUSH: the keystrokes typed meanwhile are kept
        termios.tcsetattr(fd, termios.TCSANOW, saved)


# Said once when a command runs the embedded demo checkpoint because no MODEL was given.
DEMO_NOTE = (
    "(no MODEL given: using the embedded demo checkpoint, a small Qwen2-VL trained on synthetic "
    "shapes; it knows nothing else: see docs/demo-model.md)"
)


def run(args: argparse.Namespace, model: str | None, question: str | None) -> int:
    from vlmserve import LLM

    if model is None:
        print(DEMO_NOTE, file=sys.stderr)
    llm = LLM(
        model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        max_num_seqs=1,
        limit_mm_per_prompt={"image": max(8, len(args.image)), "video": max(1, len(args.video))},
        generation_config=args.generation_config,
        attention_backend=args.attention_backend,
        **parallel_options(args),
    )
    chat = Chat(llm, args)
    if question is not None:
        with typing_held_back(sys.stdin):
            return chat.ask(question)
    return chat.loop(sys.stdin)


def _box_convention(llm: LLM, args: argparse.Namespace) -> GroundingConvention:
    """--box-convention's, or the one the model's family writes in."""
    from vlmserve.registry import family_of, grounding_convention

    if args.box_convention is not None:
        return grounding_convention(args.box_convention)
    return family_of(llm.llm_engine.model_config).grounding


def _draw_boxes(
    text: str, source: str, item: MultiModalItemInfo, convention: GroundingConvention, out: Path, stdout: IO[str]
) -> int:
    """The answer's boxes on the latest image, in its original pixels: printed, and drawn into `out`."""
    from vlmserve.grounding import draw_answer
    from vlmserve.multimodal.media import load_image

    try:
        image = load_image(source, "the latest image")  # as the processor decoded it (EXIF rotation applied)
        if image.size != tuple(item.original_size):
            raise ValueError(f"{source} is {image.size} now; the model saw it as {item.original_size}")
        _, lines = draw_answer(text, image, convention, item.resized_size, out)
    except (OSError, ValueError) as e:  # MediaError is a ValueError
        print(f"error: --draw-boxes: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines), file=stdout)
    return 0


def check_local_media(source: str, modality: str = "image") -> str | None:
    """What is wrong with an image or video given by path (None: nothing, or it is a URL, which
    is fetched when its turn is asked): checked before the model loads. An image's header is read
    too: a format vlmserve does not open, or more pixels than it takes, is said now, not after
    the model has loaded."""
    if source.startswith(("http://", "https://", "data:")):
        return None
    path = Path(source.removeprefix("file://")).expanduser()
    if not path.exists():
        return "no such file"
    if not path.is_file():
        return "not a file"
    if modality == "image":
        from vlmserve.multimodal.media import DEFAULT_LIMITS, MediaError, open_image

        try:
            open_image(path.read_bytes(), "the image")
        except MediaError as e:
            side = int(DEFAULT_LIMITS.max_image_pixels**0.5)
            fix = f"; give a smaller picture (up to {side} x {side})" if "limit" in str(e) else ""
            return str(e).removeprefix("the image: ").replace(" (a server's --max-image-pixels)", "") + fix
    return None
