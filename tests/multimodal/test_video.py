"""Video frame choice and sizing against qwen-vl-utils' own code, decoding real files, patches."""

from __future__ import annotations

import base64
import http.server
import importlib
import io
import itertools
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import color_index, video_frame, write_video
from vlmserve.multimodal import video_decode
from vlmserve.multimodal.image import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageProcessorConfig
from vlmserve.multimodal.media import MediaError, MediaLimits
from vlmserve.multimodal.video import (
    VideoOptions,
    frame_indices,
    frame_range,
    frame_size,
    list_frame_size,
    load_video,
    num_frames,
    open_video,
)

CFG = ImageProcessorConfig()


class PyAVReader:
    """decord.VideoReader's interface on PyAV (frames in presentation order), or on a synthetic
    "synthetic:frames:fps:height:width" video of black frames."""

    cache: dict[str, tuple[float, list[np.ndarray]]] = {}  # noqa: RUF012

    def __init__(self, path: str) -> None:
        if path.startswith("synthetic:"):
            count, fps, height, width = path.split(":")[1:]
            self.fps = float(fps)
            self.frames = [np.zeros((int(height), int(width), 3), np.uint8)] * int(count)
            return
        if path not in self.cache:
            import av

            with av.open(path) as container:
                stream = container.streams.video[0]
                decoded = sorted(container.decode(stream), key=lambda f: f.pts)
                self.cache[path] = float(stream.average_rate), [f.to_ndarray(format="rgb24") for f in decoded]
        self.fps, self.frames = self.cache[path]

    def __len__(self) -> int:
        return len(self.frames)

    def get_avg_fps(self) -> float:
        return self.fps

    def get_batch(self, indices: list[int]) -> Any:
        return SimpleNamespace(asnumpy=lambda: np.stack([self.frames[i] for i in indices]))


def _resized_shape(video: torch.Tensor, size: list[int], **kwargs: Any) -> Any:
    """Stands in for torchvision's resize: only the shape of its output (fetch_video calls .float() on it)."""
    out = SimpleNamespace(shape=(video.shape[0], video.shape[1], *size))
    out.float = lambda: out
    return out


def _no_torchvision(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("torchvision is not installed; the decord stand-in failed")


@pytest.fixture(scope="module")
def qvu() -> Iterator[ModuleType]:
    """qwen_vl_utils.vision_process, imported with stand-ins for torchvision (not installed here)
    and decord: its frame choice and sizing run as they are; its resize only gives the output its
    shape, and decord reads with PyAV."""
    import transformers  # noqa: F401  (it probes for torchvision once; it must find none, not these stand-ins)

    torchvision = ModuleType("torchvision")
    torchvision.__version__ = "0.20.0"  # type: ignore[attr-defined]
    tv_io = ModuleType("torchvision.io")
    tv_io.read_video = _no_torchvision  # type: ignore[attr-defined]
    transforms = ModuleType("torchvision.transforms")
    transforms.InterpolationMode = SimpleNamespace(BICUBIC="bicubic")  # type: ignore[attr-defined]
    transforms.functional = SimpleNamespace(resize=_resized_shape)  # type: ignore[attr-defined]
    torchvision.io, torchvision.transforms = tv_io, transforms  # type: ignore[attr-defined]
    decord = ModuleType("decord")
    decord.VideoReader = PyAVReader  # type: ignore[attr-defined]
    stubs = {"torchvision": torchvision, "torchvision.io": tv_io, "torchvision.transforms": transforms}
    with pytest.MonkeyPatch.context() as mp:
        for name, module in {**stubs, "decord": decord}.items():
            mp.setitem(sys.modules, name, module)
        module = importlib.import_module("qwen_vl_utils.vision_process")
        mp.setattr(module, "get_video_reader_backend", lambda: "decord")
        yield module
        for name in ("qwen_vl_utils", "qwen_vl_utils.vision_process"):
            sys.modules.pop(name, None)


def _qwen_fetch(qvu: ModuleType, ele: dict[str, Any]) -> tuple[tuple[int, int], list[int], float]:
    """(resized (height, width), frame indices, sample_fps) as qwen-vl-utils' fetch_video gives them."""
    (video, metadata), sample_fps = qvu.fetch_video(ele, return_video_sample_fps=True, return_video_metadata=True)
    return (video.shape[2], video.shape[3]), [int(i) for i in metadata["frames_indices"]], float(sample_fps)


def _options(ele: dict[str, Any]) -> VideoOptions:
    return VideoOptions.from_dict(ele, "video")


# -- frame choice -------------------------------------------------------------------------------------

FRAME_OPTIONS: list[dict[str, Any]] = [
    {},
    {"fps": 1},
    {"fps": 0.5},
    {"fps": 4.0},
    {"fps": 30},
    {"fps": 2, "min_frames": 7},
    {"fps": 2, "max_frames": 9},
    {"fps": 1, "min_frames": 10, "max_frames": 6},
    {"max_frames": 1},
    {"min_frames": 1},
    {"nframes": 1},
    {"nframes": 2},
    {"nframes": 3},
    {"nframes": 5},
    {"nframes": 8},
    {"nframes": 17},
    {"nframes": 64},
    {"nframes": 1000},
]
TOTALS = [1, 2, 3, 4, 5, 9, 24, 25, 61, 300, 1601, 10000]
VIDEO_FPS = [1.0, 23.976023976023978, 24.0, 29.97002997002997, 30.0, 60.0, 0.5]


def test_frame_count_matches_smart_nframes(qvu: ModuleType) -> None:
    compared = failed = 0
    for ele, total, video_fps in itertools.product(FRAME_OPTIONS, TOTALS, VIDEO_FPS):
        try:
            expected: int | None = qvu.smart_nframes(ele, total_frames=total, video_fps=video_fps)
        except ValueError:
            expected = None
        if expected is None:
            with pytest.raises(MediaError, match="at least 2|must be between 2|leaves fewer than 2"):
                num_frames(_options(ele), total, video_fps)
            failed += 1
        else:
            assert num_frames(_options(ele), total, video_fps) == expected, (ele, total, video_fps)
        compared += 1
    assert failed > 20 and compared - failed > 500  # both outcomes are covered


TIME_SPANS: list[tuple[float | None, float | None]] = [
    (None, None),
    (0.0, None),
    (0.5, None),
    (1.0, 2.0),
    (None, 1.5),
    (0.04, 0.9),
    (2.5, 100.0),
    (3.0, None),
    (9.9, None),
    (1.0, 1.01),
    (0.0, 0.0001),
    (100.0, None),
    (None, 0.0),
]


def test_frame_range_and_indices_match_the_decord_reader(qvu: ModuleType) -> None:
    compared = failed = 0
    for (start, end), total, video_fps in itertools.product(TIME_SPANS, [2, 10, 48, 61, 300], [24.0, 29.97, 7.5]):
        ele = {k: v for k, v in (("video_start", start), ("video_end", end)) if v is not None}
        try:
            first, last, count = qvu.calculate_video_frame_range(ele, total, video_fps)
        except ValueError:
            with pytest.raises(MediaError, match="select\\(s\\) fewer than 2 frames"):
                frame_range(total, video_fps, start, end)
            failed += 1
            continue
        assert frame_range(total, video_fps, start, end) == (first, last), (ele, total, video_fps)
        assert last - first + 1 == count
        for n in range(2, min(count, 40) + 1, 2):
            expected = torch.linspace(first, last, n).round().long().tolist()
            assert frame_indices(first, last, n) == expected
        compared += 1
    assert failed > 50 and compared > 80


def test_fps_and_nframes_together_name_both() -> None:
    with pytest.raises(MediaError, match="^clip: give fps or nframes, not both"):
        VideoOptions.from_dict({"fps": 1, "nframes": 4}, "clip")


@pytest.mark.parametrize(
    ("ele", "message"),
    [
        ({"fps": "2"}, r"fps must be a positive number up to 1e\+12, got '2'"),
        ({"fps": 0}, "fps must be a positive number"),
        ({"fps": float("nan")}, "fps must be a positive number"),
        ({"nframes": 4.0}, "nframes must be a positive integer"),
        ({"nframes": True}, "nframes must be a positive integer"),
        ({"max_frames": -2}, "max_frames must be a positive integer"),
        ({"video_start": -1}, "video_start must be a non-negative number of seconds"),
        ({"video_end": "1s"}, "video_end must be a non-negative number of seconds"),
        ({"total_pixels": 0}, "total_pixels must be a positive number"),
        ({"resized_height": 56}, "resized_height and resized_width must be given together"),
        ({"video_start": 2, "video_end": 2}, r"video_start \(2s\) must be before video_end \(2s\)"),
        ({"nframes": 10**400}, "nframes must be a positive integer up to 1e\\+12, got a very large integer"),
        ({"video_start": float("inf")}, "video_start must be a non-negative number of seconds"),
        ({"sample_fps": 1e-6}, "sample_fps must be between 0.000277778 and 1000 frames per second"),
        ({"fps": "x" * 1000}, "got 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...$"),
    ],
)
def test_bad_option_values(ele: dict[str, Any], message: str) -> None:
    with pytest.raises(MediaError, match=message):
        VideoOptions.from_dict(ele, "clip")


# -- frame size -----------------------------------------------------------------------------------------

SIZE_OPTIONS: list[dict[str, Any]] = [
    {},
    {"max_pixels": 50_000},
    {"min_pixels": 3136},
    {"min_pixels": 3136, "max_pixels": 20_000},
    {"min_pixels": 200_000},
    {"total_pixels": 2_000_000},
    {"total_pixels": 100_000, "min_pixels": 3136},
    {"total_pixels": 100_000},
    {"max_pixels": 10**9},
    {"resized_height": 100, "resized_width": 300},
    {"resized_height": 10, "resized_width": 30},
]
SIZES = [(48, 64), (360, 640), (720, 1280), (1080, 1920), (100, 1000), (1000, 100), (8, 1000), (13, 50), (29, 29)]


def test_frame_size_of_files_matches_fetch_video(qvu: ModuleType) -> None:
    compared = 0
    for ele, (height, width), nframes in itertools.product(SIZE_OPTIONS, SIZES, [2, 8]):
        if height * width * nframes > 5_000_000:
            continue
        source = f"synthetic:{nframes}:{nframes}.0:{height}:{width}"  # 1 s long: nframes at fps 2 = min 4
        full = {"video": source, "nframes": nframes, **ele}
        try:
            expected_size, indices, sample_fps = _qwen_fetch(qvu, full)
        except AssertionError:  # qwen-vl-utils asserts min_pixels <= max_pixels; we say so
            with pytest.raises(ValueError, match=r"min_pixels \(\d+\) must not exceed max_pixels"):
                frame_size(height, width, nframes, _options(ele))
            continue
        ours = frame_size(height, width, nframes, _options(ele))
        if 0 in expected_size:  # qwen-vl-utils floors a side to zero (its resize then fails); we keep one factor
            assert ours == tuple(side or 28 for side in expected_size)
            continue
        assert ours == expected_size, (ele, height, width, nframes)
        assert indices == list(range(nframes)) and sample_fps == pytest.approx(nframes)
        compared += 1
    assert compared > 150


def test_frame_size_of_frame_lists_matches_fetch_video(qvu: ModuleType) -> None:
    compared = 0
    for ele, (height, width), count in itertools.product(SIZE_OPTIONS, SIZES, [1, 3]):
        if height * width > 250_000:
            continue
        frames = [Image.fromarray(video_frame(i, width, height)) for i in range(count)]
        nframes = count + count % 2
        try:
            expected_size, indices, sample_fps = _qwen_fetch(qvu, {"video": frames, **ele})
        except ValueError as e:
            if "must be > 0" in str(e):  # qwen-vl-utils floored a side to zero; we keep one factor
                continue
            with pytest.raises(MediaError):  # qwen-vl-utils refuses the frames; so must we
                open_video(frames, _options(ele), CFG)
            continue
        except AssertionError:  # min_pixels > max_pixels
            with pytest.raises(MediaError, match="must not exceed max_pixels"):
                open_video(frames, _options(ele), CFG)
            continue
        start = list_frame_size(height, width, _options(ele))
        assert frame_size(*start, nframes, _options(ele)) == expected_size, (ele, height, width, count)
        assert len(indices) == nframes and sample_fps == 2.0
        plan = open_video(frames, _options(ele), CFG)
        assert plan.resized_size == expected_size[::-1] and plan.frame_indices == (*range(count), count - 1)[:nframes]
        compared += 1
    assert compared > 80


def test_default_sizes_follow_the_token_bounds() -> None:
    # qwen-vl-utils' defaults: frames of at least 128 and at most 768 tokens of 28 x 28 pixels.
    assert frame_size(48, 64, 4, VideoOptions()) == (280, 392)  # 140 tokens
    assert frame_size(1080, 1920, 4, VideoOptions()) == (560, 1008)  # 720 tokens
    h, w = frame_size(1080, 1920, 768, VideoOptions())  # total_pixels / 768 frames * 2 caps each frame
    assert h * w <= 128000 * 28 * 28 * 0.9 / 768 * 2
    assert frame_size(1080, 1920, 4, VideoOptions(resized_height=300, resized_width=400)) == (308, 392)


# -- real files -----------------------------------------------------------------------------------------

CODECS = {
    "mpeg4-mp4": {"codec": "mpeg4", "container": "mp4"},
    "x264-bframes-open-gop-mkv": {
        "codec": "libx264",
        "container": "matroska",
        "codec_options": {"bf": "3", "x264-params": "open-gop=1:keyint=12:min-keyint=12:scenecut=0"},
    },
    "x264-mp4": {"codec": "libx264", "container": "mp4", "codec_options": {"bf": "2"}, "gop_size": 10},
    "vp9-webm": {"codec": "libvpx-vp9", "container": "webm", "gop_size": 8},
    "mpeg4-bframes-avi": {"codec": "mpeg4", "container": "avi", "codec_options": {"bf": "2"}, "gop_size": 12},
    "mpeg2-ts": {"codec": "mpeg2video", "container": "mpegts", "gop_size": 6},
}
SMALL = {"min_pixels": 3136}  # frames at their own size (96 x 64 -> 84 x 56), not scaled up to 128 tokens
READ_OPTIONS: list[dict[str, Any]] = [
    {},
    {"fps": 1, **SMALL},
    {"fps": 7.5, **SMALL},
    {"nframes": 6, **SMALL},
    {"nframes": 5, **SMALL},
    {"nframes": 20, "video_start": 0.5, "video_end": 2.2, **SMALL},
    {"video_start": 1.3, **SMALL},
    {"video_end": 1.0, "fps": 4, **SMALL},
    {"max_frames": 4, "fps": 10, **SMALL},
]


def _frames_seen(pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> list[int]:
    """The frame index frame_color encoded in each frame the patches hold, read back from the patch
    layout: temporal patch k holds frames 2k and 2k + 1; the top half of a frame is its colour."""
    t, h, w = grid_thw
    m, p = CFG.merge_size, CFG.patch_size
    patches = pixel_values.reshape(t, h // m, w // m, m, m, 3, 2, p, p)
    frames = patches.transpose(0, 6, 1, 3, 7, 2, 4, 8, 5).reshape(2 * t, h * p, w * p, 3)
    rgb = (frames * np.asarray(OPENAI_CLIP_STD) + np.asarray(OPENAI_CLIP_MEAN)) * 255
    top = rgb[:, 2 : h * p // 2 - 2]  # away from the resize's blur at the edge of the two halves
    return [color_index(frame) for frame in top]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("videos")
    out = {}
    for name, spec in CODECS.items():
        path = root / f"{name}.{ {'matroska': 'mkv', 'mpegts': 'ts'}.get(spec['container'], spec['container']) }"
        path.write_bytes(write_video(61, fps=24, width=96, height=64, **spec))
        out[name] = path
    return out


@pytest.mark.parametrize("name", list(CODECS))
def test_decoded_frames_are_the_ones_qwen_vl_utils_picks(qvu: ModuleType, files: dict[str, Path], name: str) -> None:
    for ele in READ_OPTIONS:
        expected_size, expected_indices, expected_fps = _qwen_fetch(qvu, {"video": str(files[name]), **ele})
        processed = load_video(files[name], _options(ele), CFG)
        assert list(processed.frame_indices) == expected_indices, ele
        assert processed.sample_fps == pytest.approx(expected_fps, rel=1e-12)
        assert processed.second_per_grid_t == pytest.approx(2 / expected_fps)
        assert processed.resized_size == expected_size[::-1]
        assert _frames_seen(processed.pixel_values, processed.grid_thw) == expected_indices, ele
        t, h, w = processed.grid_thw
        assert t == len(expected_indices) // 2 and processed.pixel_values.shape == (t * h * w, 1176)


def test_sparse_frames_skip_whole_groups_undecoded(monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_video(240, fps=24, codec="libx264", container="mp4", codec_options={"bf": "2"}, gop_size=12)
    decoded = []
    real = video_decode._decode

    def counting(decoder: Any, packet: Any, av: Any) -> list[Any]:
        frames = real(decoder, packet, av)
        decoded.extend(frames)
        return frames

    monkeypatch.setattr(video_decode, "_decode", counting)
    processed = load_video(data, VideoOptions(nframes=4), CFG)
    assert processed.frame_indices == (0, 80, 159, 239)
    assert _frames_seen(processed.pixel_values, processed.grid_thw) == [0, 80, 159, 239]
    assert len(decoded) < 4 * 12 + 8  # four groups of 12 (and what the decoder held), not 240 frames


def test_every_source_gives_the_same_video(tmp_path: Path) -> None:
    data = write_video(24, fps=12, width=64, height=48)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    data_url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    options = VideoOptions(min_pixels=3136)
    reference = load_video(data, options, CFG)
    for source in (path, str(path), path.as_uri(), data_url, bytearray(data)):
        assert load_video(source, options, CFG).content_hash == reference.content_hash, source


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("www")
    (root / "clip.mp4").write_bytes(write_video(24, fps=12))

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_video_keeps_the_fetch_limits(served: str) -> None:
    processed = load_video(f"{served}/clip.mp4", VideoOptions(min_pixels=3136), CFG)
    assert processed.frame_indices == (0, 8, 15, 23)
    with pytest.raises(MediaError, match="^clip: download exceeds the 1000-byte limit"):
        load_video(f"{served}/clip.mp4", label="clip", limits=MediaLimits(max_video_bytes=1000))
    with pytest.raises(MediaError, match="^clip: fetching the URL returned HTTP 404"):
        load_video(f"{served}/missing.mp4", label="clip")


# -- pixel values against qwen-vl-utils + transformers ---------------------------------------------


def torchvision_resize(img: torch.Tensor, size: list[int], interpolation: str, antialias: bool = True) -> torch.Tensor:
    """torchvision.transforms.functional.resize on a tensor, as torchvision computes it
    (functional.resize, then _functional_tensor.resize): nothing when the size is already right;
    else to float32, interpolate (align_corners=False, with antialias), clamp to 0..255 for
    bicubic on uint8, round and cast back. The stand-in qwen-vl-utils' fetch_video resizes with."""
    if list(img.shape[-2:]) == list(size):
        return img
    out_dtype = img.dtype
    x = img if img.dtype in (torch.float32, torch.float64) else img.to(torch.float32)
    x = torch.nn.functional.interpolate(
        x, size=list(size), mode=interpolation, align_corners=False, antialias=antialias
    )
    if interpolation == "bicubic" and out_dtype == torch.uint8:
        x = x.clamp(min=0, max=255)
    if x.dtype != out_dtype:
        x = x.round().to(out_dtype)
    return x


def torchvision_normalize(image: torch.Tensor, mean: Any, std: Any, inplace: bool = False) -> torch.Tensor:
    """torchvision.transforms.v2.functional.normalize on a float image, as torchvision computes it."""
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)


@pytest.fixture(scope="module")
def hf_video_processor() -> Iterator[Any]:
    """transformers' Qwen2VLVideoProcessor (transformers 5.23). Its module imports torchvision's v2
    functional API (not installed here); with the resize left to qwen-vl-utils and the frames
    already RGB, the only function it calls is normalize (fused with the rescale)."""
    import transformers.image_processing_backends as backends

    functional = ModuleType("torchvision.transforms.v2.functional")
    functional.InterpolationMode = SimpleNamespace(BICUBIC="bicubic", BILINEAR="bilinear")  # type: ignore[attr-defined]
    functional.normalize = torchvision_normalize  # type: ignore[attr-defined]
    v2 = ModuleType("torchvision.transforms.v2")
    v2.functional = functional  # type: ignore[attr-defined]
    name = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "torchvision.transforms.v2", v2)
        mp.setitem(sys.modules, "torchvision.transforms.v2.functional", functional)
        mp.setattr(backends, "tvF", functional, raising=False)
        if "torchvision" not in sys.modules:
            mp.setitem(sys.modules, "torchvision", ModuleType("torchvision"))
        if "torchvision.transforms" not in sys.modules:
            mp.setitem(sys.modules, "torchvision.transforms", ModuleType("torchvision.transforms"))
        mp.setattr(sys.modules["torchvision.transforms"], "v2", v2, raising=False)
        mp.delitem(sys.modules, name, raising=False)
        yield importlib.import_module(name).Qwen2VLVideoProcessor()
        sys.modules.pop(name, None)


def noise_video(num_frames: int, width: int, height: int, fps: int = 4) -> tuple[bytes, list[np.ndarray]]:
    """A lossless (PNG in QuickTime) video of uniform RGB noise, and its frames."""
    import av

    rng = np.random.default_rng(num_frames * width + height)
    frames = [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(num_frames)]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mov") as out:
        stream = out.add_stream("png", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "rgb24"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue(), frames


def _qwen_pixel_values(qvu: ModuleType, processor: Any, ele: dict[str, Any]) -> tuple[np.ndarray, tuple[int, ...]]:
    """qwen-vl-utils' fetch_video (its own resize, torchvision's bicubic with antialias) then
    transformers' video processor (rescale, normalise, patches; the size qwen-vl-utils chose is
    kept, as the processor's own smart_resize keeps a size already on its grid and bounds)."""
    video = qvu.fetch_video(ele)
    out = processor(videos=[video], do_resize=False, do_convert_rgb=False, cap_pixels_per_frame=False)
    return out["pixel_values_videos"].numpy(), tuple(int(x) for x in out["video_grid_thw"][0])


PIXEL_CASES = {
    # 540 x 360 frames brought down to 336 x 224 (1.6x): antialiasing matters.
    "file-downscaled": ("file", {"nframes": 4, "min_pixels": 3136, "max_pixels": 28 * 28 * 100}, (336, 224)),
    # Frames of a list are first fitted as images (PIL, 180 x 120 to 168 x 112), then raised to
    # the video's 128-token minimum (392 x 280): two resizes in qwen-vl-utils.
    "list-twice-resized": ("list", {}, (392, 280)),
}


@pytest.mark.parametrize("case", list(PIXEL_CASES))
def test_video_pixel_values_match_qwen_vl_utils_and_transformers(
    qvu: ModuleType, hf_video_processor: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Frames of uniform noise (every pixel differs from its neighbours, so any other filter,
    antialiasing or order of resizes shows) give the same uint8 pixels, hence the same patches,
    as qwen-vl-utils' fetch_video followed by transformers' Qwen2VLVideoProcessor."""
    monkeypatch.setattr(qvu.transforms.functional, "resize", torchvision_resize)
    kind, options, resized_size = PIXEL_CASES[case]
    if kind == "file":
        data, _ = noise_video(6, 540, 360)
        path = tmp_path / "noise.mov"
        path.write_bytes(data)
        source: Any = path
        ele: dict[str, Any] = {"video": str(path), **options}
    else:
        _, frames = noise_video(3, 180, 120)
        source = frames
        ele = {"video": [Image.fromarray(f) for f in frames], **options}
    expected, grid = _qwen_pixel_values(qvu, hf_video_processor, ele)
    ours = load_video(source, _options(options), CFG)
    assert ours.resized_size == resized_size and ours.grid_thw == grid and ours.pixel_values.shape == expected.shape
    # Differences under 1e-5 are the normalisation's float rounding; anything more is a uint8
    # level (0.0146 to 0.0153 after normalisation). Allowed: one level in one value in 10^4
    # (an interpolated value a float32 rounding away from .5).
    level = 1 / 255 / min(OPENAI_CLIP_STD)
    diff = np.abs(ours.pixel_values - expected)
    differing = float((diff > 1e-5).mean())
    assert differing <= 1e-4 and float(diff.max()) <= level + 1e-5, (differing, float(diff.max()) / level)


# -- lists of frames -----------------------------------------------------------------------------------


def test_frame_lists(tmp_path: Path) -> None:
    frames = [video_frame(i, 112, 56) for i in range(5)]
    paths = []
    for i, frame in enumerate(frames):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(frame).save(paths[-1])
    options = VideoOptions(min_pixels=3136, max_pixels=112 * 56)
    sources: list[Any] = [
        frames,
        np.stack(frames),
        [Image.fromarray(f) for f in frames],
        paths,
        [str(p) for p in paths],
    ]
    results = [load_video(source, options, CFG) for source in sources]
    assert len({r.content_hash for r in results}) == 1
    first = results[0]
    # Five frames, the last repeated: three temporal patches of 2 x 4 merged tokens.
    assert first.frame_indices == (0, 1, 2, 3, 4, 4) and first.grid_thw == (3, 4, 8)
    assert first.resized_size == (112, 56) and first.original_size == (112, 56)
    assert first.sample_fps == 2.0 and first.second_per_grid_t == 1.0
    assert _frames_seen(first.pixel_values, first.grid_thw) == [0, 1, 2, 3, 4, 4]
    slow = load_video(frames, VideoOptions(min_pixels=3136, max_pixels=112 * 56, sample_fps=0.5), CFG)
    assert slow.second_per_grid_t == 4.0 and np.array_equal(slow.pixel_values, first.pixel_values)
    assert slow.content_hash != first.content_hash  # Qwen2.5-VL places it differently in time


@pytest.mark.parametrize(
    ("source", "options", "message"),
    [
        ([], VideoOptions(), "the list of frames is empty"),
        ([video_frame(0, 64, 48)] * 769, VideoOptions(), "769 frames given, at most 768 per video"),
        ([video_frame(0, 64, 48)] * 2, VideoOptions(fps=1), "fps select\\(s\\) frames of a video file"),
        ([video_frame(0, 64, 48)] * 2, VideoOptions(video_start=1), "video_start select"),
        (
            [video_frame(0, 64, 48), video_frame(1, 640, 480)],
            VideoOptions(),
            "frame 1: frames must all have one size",
        ),
        ([np.zeros((4, 4), np.uint8)], VideoOptions(), "frame 0: a frame array must be uint8 \\[height, width, 3\\]"),
        (np.zeros((2, 8, 8), np.uint8), VideoOptions(), "a video array must be uint8 \\[frames, height, width, 3\\]"),
        ([Image.new("RGB", (1, 300))], VideoOptions(), "frame 0: image aspect ratio 300.0"),
        (3.5, VideoOptions(), "expected a path, URL, bytes, a list of frames or a uint8 array"),
    ],
)
def test_bad_frame_lists(source: Any, options: VideoOptions, message: str) -> None:
    with pytest.raises(MediaError, match=message) as info:
        load_video(source, options, CFG, label="clip")
    assert str(info.value).startswith("clip")


# -- bad files -------------------------------------------------------------------------------------------


def _empty_video() -> bytes:
    """An AVI file with a video stream and no frames."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=24)
        stream.width, stream.height = 64, 48
        out.start_encoding()
    return buf.getvalue()


def test_bad_files_are_refused_before_decoding(tmp_path: Path) -> None:
    good = write_video(48, fps=24)
    hls = b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nhttp://127.0.0.1:9/x.ts\n#EXT-X-ENDLIST\n"
    cases: list[tuple[Any, VideoOptions, MediaLimits, str]] = [
        (b"", VideoOptions(), MediaLimits(), "video data is empty"),
        (b"\x00" * 4096, VideoOptions(), MediaLimits(), "cannot read the video"),
        (good[: len(good) // 2], VideoOptions(), MediaLimits(), "cannot read the video|truncated or corrupt"),
        (hls, VideoOptions(), MediaLimits(), "cannot read the video"),
        (_empty_video(), VideoOptions(), MediaLimits(), "the video holds no frames"),
        (good, VideoOptions(), MediaLimits(max_video_frames=40), "holds more than 40 frames"),
        (
            good,
            VideoOptions(),
            MediaLimits(max_video_duration_s=1.5),
            "runs 2s \\(48 frames at 24 fps\\), over the 1.5s",
        ),
        (good, VideoOptions(), MediaLimits(max_image_pixels=1000), "frames are 64x48 = 3072 pixels, over the 1000"),
        (good, VideoOptions(), MediaLimits(max_video_bytes=100), "over the 100-byte limit"),
        (write_video(1), VideoOptions(), MediaLimits(), "there are 1 frame\\(s\\) in the video; at least 2"),
        (good, VideoOptions(nframes=1), MediaLimits(), "nframes=1 \\(rounded to 0\\) must be between 2 and 48"),
        (good, VideoOptions(nframes=50), MediaLimits(), "nframes=50 \\(rounded to 50\\) must be between 2 and 48"),
        (good, VideoOptions(video_start=5.0), MediaLimits(), "video_start=5s select\\(s\\) fewer than 2 frames"),
        (good, VideoOptions(sample_fps=1), MediaLimits(), "sample_fps applies to a list of frames"),
        (good, VideoOptions(max_pixels=1000), MediaLimits(), "min_pixels \\(100352\\) must not exceed max_pixels"),
        (tmp_path / "missing.mp4", VideoOptions(), MediaLimits(), "file not found"),
        ("ftp://host/a.mp4", VideoOptions(), MediaLimits(), "unsupported URL scheme 'ftp'"),
        ("data:video/mp4;base64,%%%", VideoOptions(), MediaLimits(), "invalid base64"),
    ]
    for source, options, limits, message in cases:
        with pytest.raises(MediaError, match=message) as info:
            open_video(source, options, CFG, "clip", limits)
        assert str(info.value).startswith("clip: ")


def test_absurd_frame_rate_is_refused() -> None:
    with pytest.raises(MediaError, match="frame rate of 2000 fps"):
        open_video(write_video(8, fps=2000), VideoOptions(), CFG, "clip")
