"""Running the encoder towers well (`backends/`), with the tiny open_clip model: exact text
trimming, OOM back-off, device JPEG decode (exercised on the CPU), torch.compile with its eager
fallback, precision resolution."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import random

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

from pairclean.backends.base import cpu_bf16_native, resolve_precision
from pairclean.backends.compiled import CompiledOrEager
from pairclean.backends.device_jpeg import DeviceJpegDecoder
from pairclean.backends.inputs import DecodedImages, ImageBatch, StandardTransform, TokenBatch, stack_pixels
from pairclean.backends.oom import OomBackoff, take_rows
from pairclean.backends.text_trim import TextCuts, supports_text_trim, text_buckets, token_ends, trimmed_encode_text
from pairclean.bench.measure import DeviceReads, in_a_worker
from pairclean.data.decode import DecodeError, decode_image, decode_plain_jpeg, plain_jpeg
from pairclean.lab.coco import read_pairs
from pairclean.errors import UserError
from pairclean.backends.open_clip import OpenClipEstimator, OpenClipPreparer


pytestmark = pytest.mark.usefixtures("fresh_notices")


def _jpeg_bytes(coco_src, n):
    return [(coco_src / p["image"]).read_bytes() for p in read_pairs(coco_src)[:n]]


def _coco_pixels(estimator, coco_src, n):
    """The first `n` COCO-mini images as `estimator`'s workers would send them."""
    return estimator.preparer.collate("image", [estimator.preparer.prepare("image", d) for d in _jpeg_bytes(coco_src, n)])


def test_trimmed_text_tower_matches_the_full_context(tiny_estimator):
    captions = ["a dog", "two people riding horses along a beach at sunset while a dog runs beside them", "x"]
    tokens = tiny_estimator.tokenizer(captions)
    assert tiny_estimator.text_trim and tokens.shape[1] == 32
    full = torch.nn.functional.normalize(tiny_estimator.model.encode_text(tokens).float(), dim=-1)
    torch.testing.assert_close(tiny_estimator.encode("text", tokens), full, atol=1e-5, rtol=0)
    # Each caption alone (a shorter trim) gives its own row of the batch result.
    for i in range(len(captions)):
        torch.testing.assert_close(tiny_estimator.encode("text", tokens[i:i + 1]), full[i:i + 1], atol=1e-5, rtol=0)


def test_length_buckets_keep_rows_in_order_and_exact(tiny_estimator):
    words = "a large red star above a small blue circle on a green background near the top left corner".split()
    captions = [" ".join(words[: 1 + (i * 7) % len(words)]) for i in range(300)]
    tokens = tiny_estimator.tokenizer(captions)
    assert [len(rows) for rows in text_buckets(token_ends(tokens))] == [150, 150]
    full = torch.nn.functional.normalize(tiny_estimator.model.encode_text(tokens).float(), dim=-1)
    torch.testing.assert_close(tiny_estimator.encode("text", tokens), full, atol=1e-5, rtol=0)


def test_text_cuts_bucket_where_ops_are_cheap_and_cut_once_where_each_costs_a_launch(tiny_estimator):
    """Eager CUDA: one group (each bucket's ~600 ops cost the host a launch apiece); the CPU and
    CUDA graphs: four. A compiled tower's cuts come in steps, never past the context."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert TextCuts.for_device(cuda, compiled=False, step=16) == TextCuts(buckets=1, step=1)
    assert TextCuts.for_device(cuda, compiled=True, step=16) == TextCuts(buckets=4, step=16)
    assert TextCuts.for_device(cpu, compiled=False, step=16) == TextCuts(buckets=4, step=1)
    assert tiny_estimator.text_cuts == TextCuts(buckets=4, step=1)
    ends = torch.tensor([3, 30, 5, 31] * 150)
    assert [(len(rows), cut) for rows, cut in TextCuts(buckets=1).groups(ends, 32)] == [(600, 31)]
    assert [cut for _, cut in TextCuts(buckets=4, step=16).groups(ends, 32)] == [16, 16, 32, 32]


def test_the_text_tower_cuts_and_buckets_captions_without_reading_the_device_back(tiny_estimator):
    """Workers send each caption's end with the ids (TokenBatch): the estimator trims and buckets by
    them, so encoding a batch's captions reads nothing computed on the device back to the host. The
    same ids without their ends (as a tensor already on the device) are read back: the detector works."""
    words = "a large red star above a small blue circle on a green background near the top left corner".split()
    captions = [" ".join(words[: 1 + (i * 5) % len(words)]) for i in range(260)]
    batch = tiny_estimator.preparer.collate("text", captions)
    assert isinstance(batch, TokenBatch) and batch.ends.tolist() == token_ends(batch.tokens).tolist()
    assert [len(rows) for rows in text_buckets(batch.ends)] == [130, 130]
    with DeviceReads(batch.tokens) as with_ends:
        encoded = tiny_estimator.encode("text", batch)
    with DeviceReads(batch.tokens) as without:
        plain = tiny_estimator.encode("text", batch.tokens)
    assert with_ends.reads == 0 and without.reads > 0
    assert torch.equal(encoded, plain)
    picked = take_rows(batch, [259, 0, 7])
    assert picked.tokens.tolist() == batch.tokens[[259, 0, 7]].tolist() and picked.ends.tolist() == batch.ends[[259, 0, 7]].tolist()
    assert len(take_rows(batch, slice(10, 30))) == 20


def test_training_batches_hold_plain_token_ids(tiny_estimator):
    """Training's methods index and concatenate token ids: the trained target's preparer leaves
    the ends out, the scoring estimator's sends them."""
    from pairclean.backends.open_clip import OpenClipTarget

    target = OpenClipTarget(tiny_estimator.model_name, "none", device="cpu")
    assert isinstance(target.preparer.collate("text", ["a cat"]), torch.Tensor)
    assert isinstance(target.estimator.preparer.collate("text", ["a cat"]), TokenBatch)
    tokens = target.preparer.collate("text", ["a cat", "a dog on a mat"])
    torch.testing.assert_close(target.encode("text", tokens), target.encode("text", TokenBatch(tokens, token_ends(tokens))))


def test_a_copy_with_another_model_encodes_with_that_model(tiny_estimator):
    """Training's frozen online estimator is a copy of the estimator with `.model` replaced."""
    import copy

    frozen = copy.copy(tiny_estimator)
    frozen.model = copy.deepcopy(tiny_estimator.model)
    with torch.no_grad():
        frozen.model.text_projection.mul_(-1.0)
        frozen.model.visual.proj.mul_(-1.0)
    tokens = tiny_estimator.tokenizer(["a red circle", "two blue squares"])
    pixels = tiny_estimator.random_batch("image", 2, torch.Generator().manual_seed(0))
    torch.testing.assert_close(frozen.encode("text", tokens), -tiny_estimator.encode("text", tokens))
    torch.testing.assert_close(frozen.encode("image", pixels), -tiny_estimator.encode("image", pixels))


def test_text_trim_is_refused_where_it_would_not_be_exact(tiny_estimator):
    import open_clip

    net = open_clip.create_model("pairclean-tiny", pretrained=None)
    assert supports_text_trim(net)
    net.text_pool_type = "last"  # the last position sees the padding: trimming would change it
    assert not supports_text_trim(net)
    net.text_pool_type = "argmax"
    net.attn_mask = None  # bidirectional attention: the EOT position sees the padding
    assert not supports_text_trim(net)


def test_the_tokenizers_word_memo_is_bounded_and_its_tokens_the_same(tiny_estimator):
    """open_clip's tokenizer remembers the BPE of every word it meets; the estimator's forgets all but
    its special tokens on reaching its limit (also after a trip to a spawned worker), tokens unchanged."""
    import pickle

    from pairclean.backends.open_clip import WORD_MEMO_LIMIT, BoundedWordMemo

    assert isinstance(tiny_estimator.tokenizer.cache, BoundedWordMemo)
    assert tiny_estimator.tokenizer.cache.limit == WORD_MEMO_LIMIT
    tokenizer = pickle.loads(pickle.dumps(tiny_estimator.tokenizer))
    tokenizer.cache = BoundedWordMemo(tokenizer.cache.kept, limit=50)
    tokenizer = pickle.loads(pickle.dumps(tokenizer))
    unbounded = copy.deepcopy(tokenizer)
    unbounded.cache = dict(tokenizer.cache.kept)  # open_clip's own memo
    rng = random.Random(0)
    captions = [" ".join("".join(rng.choice("abcdefghij") for _ in range(6)) for _ in range(5)) + " 一張照片"
                for _ in range(40)] + ["a photo of a cat"] * 3
    for caption in captions:
        assert torch.equal(tokenizer([caption]), unbounded([caption]))
        assert len(tokenizer.cache) <= 50
    assert tokenizer.cache.limit == 50 and len(unbounded.cache) > 200
    assert tokenizer.cache.kept.items() <= tokenizer.cache.items() and tokenizer.cache["cat"] == "cat</w>"


def test_oom_backoff_halves_once_keeps_the_size_and_reports_once(caplog):
    calls = []

    def encode(batch):
        calls.append(batch.shape[0])
        if batch.shape[0] > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch * 2

    backoff = OomBackoff()
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        first = backoff(encode, torch.arange(10.0).view(10, 1))
        second = backoff(encode, torch.arange(5.0).view(5, 1))
    torch.testing.assert_close(first, torch.arange(10.0).view(10, 1) * 2)
    torch.testing.assert_close(second, torch.arange(5.0).view(5, 1) * 2)
    assert backoff.chunk == 2 and backoff.halvings == 2  # 10 -> 5 -> 2, then kept for the next batch
    assert calls == [10, 5, 2, 2, 2, 2, 2, 2, 2, 1]
    assert sum("out of memory" in r.getMessage() for r in caplog.records) == 1


def test_oom_backoff_leaves_other_errors_alone():
    def broken(batch):
        raise ValueError("not a memory problem")

    with pytest.raises(ValueError):
        OomBackoff()(broken, torch.zeros(4, 1))


def test_take_rows_keeps_the_batch_kind():
    batch = {"input_ids": torch.arange(8).view(4, 2), "mask": torch.ones(4, 2)}
    picked = take_rows(batch, [0, 3])
    assert picked["input_ids"].tolist() == [[0, 1], [6, 7]] and picked["mask"].shape == (2, 2)
    assert take_rows(["a", "b", "c"], [2, 0]) == ["c", "a"]
    assert take_rows(torch.arange(5), slice(1, 3)).tolist() == [1, 2]


def _device_decoder(estimator) -> DeviceJpegDecoder:
    """What OpenClipEstimator holds with --decode gpu on CUDA, here on the CPU."""
    preprocess = estimator.preparer.preprocess
    return DeviceJpegDecoder(StandardTransform.parse(preprocess), torch.device("cpu"), preprocess)


@pytest.mark.parametrize("decode", ["exact", "fast"])
def test_workers_send_uint8_pixels_that_normalise_on_the_device_to_torchvisions_floats(decode, coco_src):
    """`exact`: the model's own preprocessing bit for bit; `fast` (torch's resize): within 2 grey levels."""
    torch.manual_seed(0)
    estimator = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", decode=decode)
    datas = _jpeg_bytes(coco_src, 4)
    prepared = [estimator.preparer.prepare("image", d) for d in datas]
    batch = estimator.preparer.collate("image", prepared)
    assert batch.dtype == torch.uint8 and batch.shape == (4, 3, 64, 64)
    # stacked in the layout the worker's images have, no transpose copied: PIL's HWC, torch's resize planar
    assert batch.is_contiguous(memory_format=torch.channels_last if decode == "exact" else torch.contiguous_format)
    draft = estimator.preparer.draft_size
    assert draft == (None if decode == "exact" else 64)
    reference = torch.stack([estimator.preparer.preprocess(decode_image(d, draft_size=draft)) for d in datas])
    normalised = estimator.image_input(batch)
    assert normalised.is_contiguous()
    if decode == "exact":
        assert torch.equal(normalised, reference)
        assert torch.equal(estimator.encode("image", batch), estimator.encode("image", reference))
    else:
        levels = (normalised - reference) * torch.tensor(estimator.std).view(1, 3, 1, 1) * 255
        assert 0 < levels.abs().max() <= 2 + 1e-4  # torch's fixed point rounds otherwise in places, never far


@pytest.mark.parametrize("way", ["fast", "exact", "device_jpeg", "device_resize"])
def test_a_list_of_images_is_prepared_as_each_one_alone_its_decodes_a_run_ahead_of_its_resizes(
        way, tiny_estimator, coco_src, monkeypatch):
    """`prepare_many` (the workers' way) gives `prepare`'s item for each value, in order, and the
    exception `prepare` raises for one that fails; a run's images are decoded before any is
    finished, a run ending at IMAGE_RUN images or once its images hold IMAGE_RUN_BYTES."""
    import pairclean.backends.open_clip as oc
    from pairclean.backends.base import prepare_each

    base = tiny_estimator.preparer
    preparer = {"fast": base, "exact": type(base)(base.preprocess, base.tokenizer, base.draft_size, exact=True),
                "device_jpeg": copy.copy(base), "device_resize": copy.copy(base)}[way]
    if way.startswith("device"):
        setattr(preparer, way, True)
    image = Image.open(io.BytesIO(_jpeg_bytes(coco_src, 1)[0])).convert("RGB")
    encoded = {}
    for name, (picture, fmt, kwargs) in {"small": (image.resize((90, 70)), "JPEG", {}),
                                         "progressive": (image.resize((80, 100)), "JPEG", {"progressive": True}),
                                         "cmyk": (image.resize((70, 70)).convert("CMYK"), "JPEG", {}),
                                         "png": (image.resize((64, 96)), "PNG", {}),
                                         "big": (image.resize((1200, 900)), "JPEG", {})}.items():
        buffer = io.BytesIO()
        picture.save(buffer, format=fmt, **kwargs)
        encoded[name] = buffer.getvalue()
    values = [encoded[n] for n in ("small", "progressive", "cmyk", "png", "big", "small", "png", "progressive")]
    values[2:2] = [b"\xff\xd8\xff" + b"x" * 40]  # a JPEG that is not one
    values[6:6] = [encoded["small"][:200]]  # cut short
    alone = []
    for value in values:
        try:
            alone.append(preparer.prepare("image", value))
        except Exception as exc:
            alone.append(exc)
    steps = []
    for step in ("_opened", "_finished"):
        original = getattr(type(preparer), step)
        monkeypatch.setattr(type(preparer), step, lambda self, x, _step=step, _original=original:
                            steps.append(_step[1]) or _original(self, x))
    for run, run_bytes in ((3, 1 << 30), (3, 1)):
        monkeypatch.setattr(oc, "IMAGE_RUN", run)
        monkeypatch.setattr(oc, "IMAGE_RUN_BYTES", run_bytes)
        steps.clear()
        prepared = prepare_each(preparer, "image", values)
        assert [i for i, item in enumerate(prepared) if isinstance(item, Exception)] == [2, 6]
        for item, expected in zip(prepared, alone, strict=True):
            assert type(item) is type(expected)
            if isinstance(item, Exception):
                assert str(item) == str(expected)
            elif isinstance(item, bytes):
                assert item == expected
            else:
                assert torch.equal(torch.as_tensor(np.asarray(item)), torch.as_tensor(np.asarray(expected)))
        # decodes ("o"), then the finishing of those that decoded ("f"), a run at a time; with a bound
        # of one byte a run ends at each image decoded here (a JPEG left to the device holds no pixels)
        expected_steps, run_opened, run_finished = "", 0, 0
        for i, item in enumerate(alone):
            run_opened += 1
            run_finished += not isinstance(item, Exception)
            holds = not isinstance(item, (Exception, bytes))
            if run_opened == run or run_bytes == 1 and holds or i == len(alone) - 1:
                expected_steps += "o" * run_opened + "f" * run_finished
                run_opened = run_finished = 0
        assert "".join(steps) == expected_steps


def test_a_batch_keeps_the_layout_most_of_its_images_have():
    """PIL's HWC images stack channels-last, torch's planar crops planar, a mixed batch as most of
    its images are: the same values every way, no transpose copied for the majority."""
    generator = torch.Generator().manual_seed(0)
    hwc = [torch.randint(0, 256, (8, 8, 3), dtype=torch.uint8, generator=generator) for _ in range(3)]
    planar = [torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=generator).permute(1, 2, 0)
              for _ in range(3)]
    for items, layout in ((hwc, torch.channels_last), (planar, torch.contiguous_format),
                          (hwc[:1] + planar, torch.contiguous_format), (planar[:1] + hwc, torch.channels_last)):
        batch = stack_pixels(items)
        assert batch.shape == (len(items), 3, 8, 8) and batch.is_contiguous(memory_format=layout)
        assert torch.equal(batch, torch.stack([item.permute(2, 0, 1) for item in items]))


def test_fast_pixels_are_pils_within_two_grey_levels_and_pils_where_torch_cannot_stand_in(coco_src):
    """`fast_pixels` (torch's antialiased uint8 resize) against PIL's: on photos, PIL's own resize
    (`geometry_pixels`, the model's) within 2 grey levels; on noise, from 1 x 1 to 4,000 x 3,000 up
    and down, PIL's two passes in torch's order (horizontal first: Pillow 13.0 runs the vertical one
    first for some sizes, and on noise the overshoot clipped between them then moves values by
    10-20). Both filters torch has, three preprocessings; PIL's own pixels for a filter torch lacks,
    a Resize below the crop, and slivers."""
    from torchvision.transforms import CenterCrop, Compose, Normalize, Resize, ToTensor
    from torchvision.transforms.functional import pil_modes_mapping

    from pairclean.backends.resample import crop_start, resized_size

    rng = np.random.default_rng(0)
    sizes = [(1, 1), (2, 3), (10, 10), (223, 224), (224, 224), (312, 207), (207, 312), (384, 256), (640, 480),
             (4000, 3000), (90, 1000), (7, 500)]
    noise = [Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)) for w, h in sizes]
    photos = [decode_image(d) for d in _jpeg_bytes(coco_src, 8)]

    def transform(resize, crop, interpolation=InterpolationMode.BICUBIC):
        return StandardTransform.parse(Compose([Resize(resize, interpolation=interpolation), CenterCrop(crop),
                                                ToTensor(), Normalize((0.5,) * 3, (0.5,) * 3)]))

    def horizontal_first(t, image):
        height, width = resized_size(image.height, image.width, t.resize)
        flt = pil_modes_mapping[t.interpolation]
        resized = image.resize((width, image.height), flt).resize((width, height), flt)
        top, left = crop_start(height, t.crop), crop_start(width, t.crop)
        return torch.from_numpy(np.array(resized.crop((left, top, left + t.crop, top + t.crop))))

    differing = []
    for interpolation in (InterpolationMode.BICUBIC, InterpolationMode.BILINEAR):
        for resize, crop in ((224, 224), (256, 224), (64, 64)):
            t = transform(resize, crop, interpolation)
            assert t.resamplable and t.filter_name == interpolation.value
            for image, photo in [(p, True) for p in photos] + [(n, False) for n in noise]:
                fast = t.fast_pixels(image)
                assert fast.shape == (crop, crop, 3) and fast.dtype == torch.uint8
                # the crop alone is kept (HWC, or planar where torch resized), not the whole resized image
                assert fast.untyped_storage().nbytes() == crop * crop * 3
                assert fast.is_contiguous() or fast.permute(2, 0, 1).is_contiguous()
                if t.resizes_to_sliver(*image.size):
                    assert torch.equal(fast, t.geometry_pixels(image))  # resized over the crop's window, by PIL
                    continue
                reference = t.geometry_pixels(image) if photo else horizontal_first(t, image)
                gap = (fast.int() - reference.int()).abs()
                assert gap.max() <= 2 and (gap > 0).float().mean() < 0.03, (image.size, resize, crop)
                differing.append(bool(gap.any()))
    assert any(differing) and not all(differing)
    for t in (transform(224, 224, InterpolationMode.LANCZOS), transform(200, 224)):
        assert not t.resamplable
        for image in photos[:2] + noise[:8]:
            assert torch.equal(t.fast_pixels(image), t.geometry_pixels(image))


def test_device_jpeg_decode_matches_pil_preprocessing(tiny_estimator, coco_src):
    datas = _jpeg_bytes(coco_src, 6)
    batch = tiny_estimator.preparer.leaving_to(DeviceJpegDecoder).collate("image", datas)  # JPEGs a worker left for the device
    assert isinstance(batch, ImageBatch) and batch.jpeg_rows == tuple(range(6)) and batch.decoded is None
    assert [batch.jpegs.file_bytes(i) for i in range(6)] == datas  # one tensor, the files back to back
    pixels, failed = _device_decoder(tiny_estimator)(batch)
    preprocess = tiny_estimator.preparer.preprocess
    reference = torch.stack([StandardTransform.parse(preprocess).geometry_pixels(Image.open(io.BytesIO(d)).convert("RGB"))
                             for d in datas]).permute(0, 3, 1, 2)
    assert failed == {} and pixels.dtype == torch.uint8 and pixels.shape == reference.shape
    # One batched resize for every size vs PIL's per image: at most one grey level apart, rarely.
    difference = (pixels.int() - reference.int()).abs()
    assert difference.max() <= 1 and (difference > 0).float().mean() < 0.01


def test_batched_resize_crop_matches_pil_on_every_kind_of_size():
    from pairclean.backends.device_jpeg import resize_many

    generator = torch.Generator().manual_seed(0)
    sizes = [(64, 64), (65, 64), (40, 300), (300, 40), (17, 23), (500, 333), (64, 90)]  # same, tall, wide, upscale
    smooth = [torch.nn.functional.interpolate(torch.rand((1, 3, 8, 8), generator=generator) * 255, size=s,
                                              mode="bilinear", align_corners=False)[0].round().to(torch.uint8)
              for s in sizes]
    out = resize_many(smooth, 64, 56, "bicubic")
    for image, got in zip(smooth, out):
        pil = Image.fromarray(image.permute(1, 2, 0).numpy())
        expected = torch.from_numpy(np.array(
            F.center_crop(F.resize(pil, [64], interpolation=InterpolationMode.BICUBIC), [56, 56]))).permute(2, 0, 1)
        assert (got.int() - expected.int()).abs().max() <= 1


def test_plain_jpeg_leaves_rotated_cmyk_draft_scaled_and_other_images_to_pil(coco_src):
    jpeg = _jpeg_bytes(coco_src, 1)[0]
    image = Image.open(io.BytesIO(jpeg))
    assert plain_jpeg(jpeg) and min(image.size) >= 128
    assert plain_jpeg(jpeg, draft_size=min(image.size) // 2 + 1) and not plain_jpeg(jpeg, draft_size=min(image.size) // 2)
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90: PIL's path applies it, nvjpeg would not
    rotated, cmyk, png = io.BytesIO(), io.BytesIO(), io.BytesIO()
    image.save(rotated, format="JPEG", exif=exif)
    image.convert("CMYK").save(cmyk, format="JPEG")
    image.save(png, format="PNG")
    assert not any(plain_jpeg(x.getvalue()) for x in (rotated, cmyk, png))
    assert not plain_jpeg(jpeg, max_pixels=image.width * image.height - 1) and not plain_jpeg(jpeg[:2] + b"x" * 50)


def _header_segments(jpeg: bytes) -> list[int]:
    """Where each segment of a JPEG's header starts, its scan's last."""
    at, starts = 2, []
    while at + 4 <= len(jpeg):
        starts.append(at)
        if jpeg[at + 1] == 0xDA:
            break
        at += 2 + int.from_bytes(jpeg[at + 2:at + 4], "big")
    return starts


def test_the_header_scan_answers_as_pil_does_or_leaves_the_header_to_pil(coco_src):
    """`_ordinary_header` (no PIL) answers for ordinary JPEG headers, and only where its answer is
    PIL's: real JPEGs, the ways PIL writes them, and thousands of their headers corrupted (bytes
    changed, segments cut, lengths wrong)."""
    from pairclean.data.decode import _ordinary_header, _pil_header

    real = _jpeg_bytes(coco_src, 16)
    image = Image.open(io.BytesIO(real[0])).convert("RGB").resize((160, 120))
    rotated, upright = Image.Exif(), Image.Exif()
    rotated[0x0112], upright[0x0112] = 6, 1
    xmp = b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
    ways = {"baseline": {}, "progressive": {"progressive": True}, "optimized": {"optimize": True},
            "444": {"subsampling": 0}, "comment": {"comment": b"<script>x</script>"},
            "restarts": {"restart_marker_blocks": 4}, "icc": {"icc_profile": b"\0" * 128}, "dpi": {"dpi": (300, 300)},
            "exif-rotated": {"exif": rotated.tobytes()}, "exif-upright": {"exif": upright.tobytes()}, "xmp": {"xmp": xmp}}
    made = {}
    for name, kwargs in ways.items():
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", **kwargs)
        made[name] = buffer.getvalue()
    for mode in ("L", "CMYK"):
        buffer = io.BytesIO()
        image.convert(mode).save(buffer, format="JPEG")
        made[mode] = buffer.getvalue()
    buffer = io.BytesIO()
    image.save(buffer, format="MPO", save_all=True, append_images=[image.rotate(90)])  # a phone's two pictures
    made["mpo"] = buffer.getvalue()
    # What it answers itself, and what it leaves to PIL: EXIF and XMP (orientation), CMYK, MPO
    answered = {name for name, jpeg in made.items() if _ordinary_header(jpeg) is not None}
    assert answered == set(ways) - {"exif-rotated", "exif-upright", "xmp"} | {"L"}
    assert _pil_header(made["mpo"]) == (160, 120, False)
    assert _pil_header(made["exif-rotated"]) is None and _pil_header(made["xmp"]) is None
    assert _ordinary_header(made["progressive"]) == (160, 120, True) == _pil_header(made["progressive"])
    # Headers PIL refuses, each whole and well chained: left to PIL, which says why
    jpeg = made["baseline"]
    frame = next(at for at in _header_segments(jpeg) if jpeg[at + 1] == 0xC0)
    length = int.from_bytes(jpeg[frame + 2:frame + 4], "big")
    # two bytes more in the frame segment: its components' list ends in a torn entry
    torn_frame = (jpeg[:frame + 2] + (length + 2).to_bytes(2, "big") + jpeg[frame + 4:frame + 2 + length]
                  + b"\0\0" + jpeg[frame + 2 + length:])
    height_width = frame + 5
    bomb = jpeg[:height_width] + (20_000).to_bytes(2, "big") * 2 + jpeg[height_width + 4:]  # 400 Mpixels
    after_soi = lambda segment: jpeg[:2] + segment + jpeg[2:]
    refused = {"torn frame": torn_frame, "bomb": bomb, "short JFIF": after_soi(b"\xff\xe0\x00\x07JFIF\x00"),
               "short Adobe": after_soi(b"\xff\xee\x00\x07Adobe"),
               "short ICC": after_soi(b"\xff\xe2\x00\x0fICC_PROFILE\x00\x01")}
    for name, data in refused.items():
        assert _pil_header(data) is None and _ordinary_header(data) is None, name

    rng = random.Random(0)
    cases = answers = 0
    for jpeg in real + list(made.values()):
        starts = _header_segments(jpeg)
        header_end = starts[-1] + 14
        mutants = [jpeg[:rng.randrange(2, header_end)] for _ in range(10)]
        for _ in range(60):  # a byte of the header changed, most often a marker, a length or a segment's first bytes
            data = bytearray(jpeg)
            at = rng.choice(starts) + rng.randrange(1, 11) if rng.random() < 0.7 else rng.randrange(2, header_end)
            data[at] = rng.choice([0, 1, 2, 7, 8, 0xC0, 0xC2, 0xDA, 0xE1, 0xFF, rng.randrange(256)])
            mutants.append(bytes(data))
        for data in [jpeg] + mutants:
            ordinary = _ordinary_header(data)
            cases += 1
            if ordinary is not None:
                answers += 1
                assert ordinary == _pil_header(data), (ordinary, _pil_header(data))
    assert answers > cases // 3  # it answers: a scan that never did would pass the rest


def _small_jpegs(coco_src) -> dict[str, bytes]:
    """Web-sized JPEGs (no draft scaling at 64 px) of several kinds, and broken ones."""
    image = Image.open(io.BytesIO(_jpeg_bytes(coco_src, 1)[0])).resize((120, 90))
    made = {}
    for name, kwargs in {"baseline": {}, "progressive": {"progressive": True}, "444": {"subsampling": 0},
                         "low": {"quality": 20}}.items():
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", **kwargs)
        made[name] = buffer.getvalue()
    buffer = io.BytesIO()
    image.convert("L").save(buffer, format="JPEG")
    made["grey"] = buffer.getvalue()
    data = made["baseline"]
    made["extraneous"] = data[:-2] + b"\x00" * 64 + data[-2:]  # libjpeg warns and decodes; so does PIL
    made["truncated"] = data[:len(data) // 2]
    return made


def test_a_worker_decodes_plain_jpegs_with_libjpeg_to_pils_pixels_and_keeps_its_warnings_quiet(coco_src, capfd):
    """`decode_plain_jpeg` in a DataLoader worker: PIL's pixels exactly (baseline, progressive,
    4:4:4, greyscale, a file with stray bytes), None for a file libjpeg refuses (PIL then says why),
    and nothing on stderr, which libjpeg writes to otherwise; outside a worker, None (PIL decodes)."""
    jpegs = _small_jpegs(coco_src)
    assert decode_plain_jpeg(jpegs["baseline"]) is None  # the main process
    decoded = in_a_worker(decode_plain_jpeg, list(jpegs.values()))
    for (name, data), pixels in zip(jpegs.items(), decoded):
        if name == "truncated":
            assert pixels is None
            with pytest.raises(DecodeError, match="truncated"):
                decode_image(data)
            continue
        assert torch.equal(pixels, torch.from_numpy(np.array(decode_image(data))).permute(2, 0, 1)), name
    assert "Corrupt JPEG" not in capfd.readouterr().err

    def loud(data):
        from torchvision.io import decode_jpeg

        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    in_a_worker(loud, [jpegs["extraneous"]])  # libjpeg unsilenced: what the quiet call keeps off the terminal
    assert "Corrupt JPEG data" in capfd.readouterr().err


@pytest.mark.parametrize("way", ["fast", "gpu-resize", "gpu-share"])
def test_workers_send_the_main_processs_pixels(way, coco_src):
    """A preparer in a worker (libjpeg's decode) and in the main process (PIL's) sends the same
    batch - `fast`'s resized pixels, or the decoded images a device resizes (gpu-resize; gpu's
    share of the JPEGs) - and the same refusal."""
    from pairclean.backends.device_jpeg import DEVICE_DECODERS

    torch.manual_seed(0)
    preparer = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", decode="fast").preparer
    if way == "gpu-resize":
        preparer = preparer.leaving_to(DEVICE_DECODERS["gpu-resize"])
    elif way == "gpu-share":
        preparer = copy.copy(preparer.leaving_to(DeviceJpegDecoder))
        preparer.cpu_decode_share = 1.0  # every JPEG decoded in the workers, resized on the device
    jpegs = _small_jpegs(coco_src)
    readable = [data for name, data in jpegs.items() if name != "truncated"]
    assert all(plain_jpeg(data, preparer.draft_size) for data in readable)
    assert preparer.worker_resize == ("torch" if way == "fast" else None)
    in_worker = in_a_worker(lambda data: preparer.prepare("image", data), readable)
    here = [preparer.prepare("image", data) for data in readable]
    if way != "fast":  # PIL's images here, libjpeg's pixels there
        assert all(isinstance(x, Image.Image) for x in here) and all(isinstance(x, torch.Tensor) for x in in_worker)
    batches = [preparer.collate("image", items) for items in (in_worker, here)]
    if way == "fast":
        assert torch.equal(*batches)
    else:
        decoded = [b if way == "gpu-resize" else b.decoded for b in batches]
        assert decoded[0].shapes == decoded[1].shapes and torch.equal(decoded[0].data, decoded[1].data)
    refused = in_a_worker(lambda data: _refusal(preparer, data), [jpegs["truncated"]])
    assert refused == [_refusal(preparer, jpegs["truncated"])] and "truncated" in refused[0]


def _refusal(preparer, data) -> str | None:
    try:
        preparer.prepare("image", data)
    except DecodeError as exc:
        return str(exc)
    return None


def test_finish_on_device_turns_undecodable_jpegs_into_error_rows_and_keeps_sides_aligned(tiny_estimator, coco_src):
    from pairclean.scoring.batches import PairBatch, UnitSpan
    from pairclean.scoring.pipeline import finish_on_device

    good = _jpeg_bytes(coco_src, 3)
    middle = len(good[1]) // 2  # a frame marker midway through the scan: the workers' checks pass it, decoding fails
    broken = good[1][:middle] + b"\xff\xc0" + good[1][middle + 2:]
    png = io.BytesIO()
    Image.open(io.BytesIO(good[2])).save(png, format="PNG")
    images = [good[0], broken, png.getvalue(), good[2]]
    preparer = OpenClipPreparer(tiny_estimator.preparer.preprocess, tiny_estimator.tokenizer, draft_size=None,
                                device_jpeg=True, token_ends=True)
    prepared = [preparer.prepare("image", x) for x in images]
    assert [isinstance(p, bytes) for p in prepared] == [True, True, False, True]  # PNG decoded in the worker
    captions = ["zero", "one", "two", "three"]
    batch = PairBatch([UnitSpan("u", 0, 5)], ["a", "b", "c", "d", "e"], ["s"] * 5, list(range(5)),
                      [None, None, "bad caption", None, None], preparer.collate("image", prepared),
                      preparer.collate("text", captions))

    class OnCpu:  # the estimator's device preprocessing with --decode gpu on CUDA, here on the CPU
        finish_batch = type(tiny_estimator).finish_batch
        device_decoder = _device_decoder(tiny_estimator)

    out = finish_on_device(OnCpu(), batch, "image", "text")
    assert out.error[0] is None and out.error[2] == "bad caption"
    assert out.error[1].startswith("cannot decode image")
    assert out.left.shape[0] == len(out.right) == 3
    kept = tiny_estimator.tokenizer(["zero", "two", "three"])
    assert out.right.tokens.tolist() == kept.tolist() and out.right.ends.tolist() == token_ends(kept).tolist()
    decoded_png = DecodedImages.pack([preparer.prepare("image", png.getvalue())])  # decoded in the worker
    assert torch.equal(out.left[1], OnCpu.device_decoder.resized(decoded_png.images())[0])  # resized with the batch


def test_decode_gpu_falls_back_to_worker_decode_without_cuda(caplog):
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        est = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", decode="gpu")
    assert est.decode == "fast" and est.device_decoder is None and not est.preparer.device_jpeg
    assert any("`decode` gpu needs a CUDA device" in r.getMessage() for r in caplog.records)
    with pytest.raises(UserError, match="unknown decode"):
        OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", decode="turbo")


def test_precision_auto_and_bf16_detection():
    cpu = torch.device("cpu")
    assert resolve_precision(cpu, "auto") == ("bf16" if cpu_bf16_native() else "fp32")
    assert resolve_precision(cpu, "fp32") == "fp32"
    with pytest.raises(UserError, match="needs a CUDA device"):
        resolve_precision(cpu, "fp16")
    with pytest.raises(UserError, match="unknown precision"):
        resolve_precision(cpu, "fp8")


def test_bf16_on_cpu_stays_close_to_fp32(tiny_estimator, coco_src):
    torch.manual_seed(0)
    bf16 = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", precision="bf16")
    pixels = _coco_pixels(tiny_estimator, coco_src, 4)
    cos = (tiny_estimator.encode("image", pixels) * bf16.encode("image", pixels)).sum(-1)
    assert cos.min() > 0.99


def _attention_calls(model: torch.nn.Module) -> list[tuple[torch.dtype, bool]]:
    """(query dtype, autocast on) of every MultiheadAttention call in `model` from now on."""
    seen = []
    for module in model.modules():
        if isinstance(module, torch.nn.MultiheadAttention):
            module.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, torch.is_autocast_enabled("cpu"))))
    return seen


def test_bf16_transformer_towers_run_in_their_stored_weights_without_autocast(coco_src):
    """Autocast shuts MultiheadAttention's fused path (on CUDA: 577 aten ops for ViT-B-32's image
    tower instead of 193); open_clip's own towers run bf16 without it, and on the CPU give exactly
    what autocast gave. Beta's noise images (floats) take the same path."""
    torch.manual_seed(0)
    est = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", precision="bf16")
    assert est.autocast == {"image": False, "text": False}
    assert est.provenance()["autocast"] == {"image": False, "text": False}
    pixels = _coco_pixels(est, coco_src, 4)
    tokens = est.tokenizer(["a dog on a beach", "two people riding horses along a beach at sunset", "x", "a red car"])
    noise = est.random_batch("image", 3, torch.Generator().manual_seed(1))
    seen = _attention_calls(est.model)
    stored = [est.encode("image", pixels), est.encode("text", tokens), est.encode("image", noise)]
    assert seen and set(seen) == {(torch.bfloat16, False)}
    est.autocast = {"image": True, "text": True}  # the earlier way: the same weights under autocast
    seen.clear()
    under_autocast = [est.encode("image", pixels), est.encode("text", tokens), est.encode("image", noise)]
    assert seen and all(on for _, on in seen)
    for a, b in zip(stored, under_autocast):
        assert torch.equal(a, b)


def _on_fake_cuda(net: torch.nn.Module, mode) -> torch.nn.Module:
    """`net` with every parameter and buffer a fake CUDA tensor (`FakeTensorMode`): ops then run
    CUDA's dtype and device checks, with no GPU and no arithmetic."""
    for name, tensor in [*net.named_parameters(), *net.named_buffers()]:
        path, _, leaf = name.rpartition(".")
        owner = net.get_submodule(path)
        fake = mode.from_tensor(tensor.detach(), static_shapes=True).to("cuda")
        if isinstance(tensor, torch.nn.Parameter):
            owner._parameters[leaf] = torch.nn.Parameter(fake, requires_grad=False)
        else:
            owner._buffers[leaf] = fake
    return net


def test_towers_in_their_stored_dtype_pass_cudas_dtype_checks(monkeypatch):
    """CUDA's layer norm refuses bf16 input with fp32 weights, which a CPU's takes: every bf16 run
    on a GPU failed at its first batch until the towers' layer norms computed in fp32 there
    (`_layer_norms_in_fp32`, applied on CUDA only, so CPU scores do not move). Checked on fake
    CUDA tensors (their ops run CUDA's dtype and device checks, no arithmetic): the estimator made
    as on CUDA (`_for_cuda`) encodes pixels and beta's noise images, its text tower captions; the
    towers as built for the CPU are refused there."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    from pairclean.backends.open_clip import _for_cuda, _plain_encode_image

    torch.manual_seed(0)
    est = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", precision="bf16")
    assert est.autocast == {"image": False, "text": False} and est.stored_towers == ["image", "text"]
    assert not any(type(m).__name__ == "LayerNormFp32" for m in est.model.modules())  # the CPU's kernel, as before
    tokens = est.tokenizer(["a dog on a beach", "two people riding horses along a beach at sunset", "x", "a red car"])
    pixels = torch.randint(0, 256, (4, 3, est.image_size, est.image_size), dtype=torch.uint8)
    noise = est.random_batch("image", 3, torch.Generator().manual_seed(1))
    cut = int(token_ends(tokens).max())  # one group, cut at the longest caption, as CUDA runs the text tower
    as_built = copy.deepcopy(est.model)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)  # `_for_cuda` sets it
    _for_cuda(est.model, est.stored_towers)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        bf16 = torch.empty((4, 3, est.image_size, est.image_size), dtype=torch.bfloat16, device="cuda")
        as_built = _on_fake_cuda(as_built, mode)
        for tower, inputs in ((_plain_encode_image, (bf16,)), (trimmed_encode_text, (tokens.to("cuda"), cut))):
            with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
                tower(as_built, *inputs)
        est.model, est.device, est.channels_last = _on_fake_cuda(est.model, mode), torch.device("cuda"), True
        for batch in (pixels, noise):  # normalised, cast and laid out channels-last as on CUDA
            with DeviceReads() as waits:
                out = est.encode("image", batch)
            assert out.device.type == "cuda" and out.dtype == torch.float32 and out.shape == (batch.shape[0], 64)
            assert not waits.sites  # nothing the host waits for (the normaliser's constants went without a wait)
        # The text tower as CUDA runs it, fused attention and all; `encode`'s grouping computes on host
        # tensors, which a fake mode fakes too.
        with torch.no_grad(), _counted_fused_attention(monkeypatch) as fused:
            text = trimmed_encode_text(est.model, tokens.to("cuda"), cut)
        assert text.device.type == "cuda" and text.dtype == torch.bfloat16 and text.shape == (4, 64)
        assert fused == [len(est.model.transformer.resblocks)]


@contextlib.contextmanager
def _counted_fused_attention(monkeypatch):
    """Counts MultiheadAttention's fused calls (`torch._native_multi_head_attention`) in a one-item list."""
    calls = [0]
    native = torch._native_multi_head_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return native(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "_native_multi_head_attention", counted)
        yield calls


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 2 ** -5)])
def test_the_fused_text_attention_is_open_clips_within_rounding_and_runs_only_on_cuda(precision, tolerance, monkeypatch):
    """On CUDA the text tower gives MultiheadAttention its causal mask as booleans, so that it takes its
    fused path (`causal_blocks`: ~19 ops a block instead of ~49 for ViT-B-32): the same attention by
    other kernels, within float rounding of open_clip's float mask (bf16: an ulp or two of the
    projection's outputs, |x| < 8). A CPU, a tower with gradients, keep open_clip's path."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pairclean.backends.text_trim import fused_attention

    torch.manual_seed(0)
    est = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", precision=precision)
    tokens = est.tokenizer(["a dog on a beach", "two people riding horses along a beach at sunset", "x", "a red car"])
    cut = int(token_ends(tokens).max())
    with torch.no_grad(), est.tower_context("text"):
        with _counted_fused_attention(monkeypatch) as calls:
            plain = trimmed_encode_text(est.model, tokens, cut, fused=False)
        assert calls == [0]
        with _counted_fused_attention(monkeypatch) as calls:
            fused = trimmed_encode_text(est.model, tokens, cut, fused=True)
        assert calls == [len(est.model.transformer.resblocks)]
        torch.testing.assert_close(fused.float(), plain.float(), atol=tolerance, rtol=0)
        x = torch.zeros((1, cut, est.model.transformer.width))
        assert not fused_attention(est.model, x) and torch.equal(trimmed_encode_text(est.model, tokens, cut), plain)
    with FakeTensorMode() as mode:
        on_cuda = mode.from_tensor(x).to("cuda")
        with torch.no_grad():
            assert fused_attention(est.model, on_cuda)
        assert not fused_attention(est.model, on_cuda)  # gradients: MultiheadAttention has no fused path for them


def test_towers_that_keep_fp32_parameters_stay_under_autocast(tmp_path):
    import open_clip

    rn = OpenClipEstimator("RN50", pretrained="none", device="cpu", precision="bf16")
    assert rn.autocast == {"image": True, "text": False}  # a ResNet image tower, open_clip's text transformer
    assert OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu").autocast == {"image": False, "text": False}
    pixels = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8)
    assert rn.encode("image", pixels).dtype == torch.float32
    # Layer scales (ViT-M-16-alt's, for one) multiply the activations by an fp32 gamma: without
    # autocast the next bf16 matmul would fail on mixed dtypes.
    cfg = open_clip.get_model_config("pairclean-tiny")
    (tmp_path / "pairclean-tiny-ls.json").write_text(json.dumps({**cfg, "vision_cfg": {**cfg["vision_cfg"], "ls_init_value": 0.1},
                                                                "text_cfg": {**cfg["text_cfg"], "ls_init_value": 0.1}}))
    open_clip.add_model_config(tmp_path)
    scaled = OpenClipEstimator("pairclean-tiny-ls", pretrained="none", device="cpu", precision="bf16")
    assert scaled.autocast == {"image": True, "text": True}
    noise = scaled.random_batch("image", 2, torch.Generator().manual_seed(0))
    assert scaled.encode("image", noise).shape == scaled.encode("text", scaled.tokenizer(["a dog", "x"])).shape == (2, 64)
    # A layer-scaled image tower beside a plain text tower: on CUDA only the text tower's layer
    # norms compute in fp32 (the image tower's run under autocast, which does that itself).
    from pairclean.backends.open_clip import _layer_norms_in_fp32

    (tmp_path / "pairclean-tiny-ls-image.json").write_text(json.dumps({**cfg, "vision_cfg": {**cfg["vision_cfg"], "ls_init_value": 0.1}}))
    open_clip.add_model_config(tmp_path)
    mixed = OpenClipEstimator("pairclean-tiny-ls-image", pretrained="none", device="cpu", precision="bf16")
    assert mixed.autocast == {"image": True, "text": False}
    assert mixed.stored_towers == ["text"]
    _layer_norms_in_fp32(mixed.model, mixed.stored_towers)
    swapped = {name.split(".")[0] for name, m in mixed.model.named_modules() if type(m).__name__ == "LayerNormFp32"}
    assert swapped == {"transformer", "ln_final"}


def test_low_precision_weights_as_open_clip_converts_them_and_linear_projections_too():
    import open_clip
    from open_clip.model import CustomTextCLIP, convert_weights_to_lp

    from pairclean.backends.open_clip import _matmul_weights_to, register_model_configs

    register_model_configs()
    ours, theirs = (open_clip.create_model("pairclean-tiny", pretrained=None) for _ in range(2))
    _matmul_weights_to(ours, torch.bfloat16)
    convert_weights_to_lp(theirs, torch.bfloat16)
    assert [(n, p.dtype) for n, p in ours.named_parameters()] == [(n, p.dtype) for n, p in theirs.named_parameters()]
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16, torch.float32}
    # SigLIP's text towers project with an nn.Linear, on which open_clip 3.3's own conversion fails.
    cfg = open_clip.get_model_config("pairclean-tiny")
    linear = CustomTextCLIP(cfg["embed_dim"], cfg["vision_cfg"], {**cfg["text_cfg"], "proj_bias": True}).eval()
    assert isinstance(linear.text.text_projection, torch.nn.Linear)
    _matmul_weights_to(linear, torch.bfloat16)
    assert linear.text.text_projection.weight.dtype == torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear.encode_text(torch.randint(0, 1000, (2, 32))).shape == (2, 64)


def _failing_compile(fn, **kwargs):
    """torch.compile as on a machine where inductor cannot build: the first call fails."""
    def compiled(*args):
        raise RuntimeError("inductor: no working C++ compiler")
    return compiled


def test_compile_failure_falls_back_to_eager_once(monkeypatch, caplog):
    monkeypatch.setattr(torch, "compile", _failing_compile)
    calls = []
    wrapped = CompiledOrEager(lambda x: calls.append(x) or x + 1, "image", torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        assert wrapped(1) == 2 and wrapped(2) == 3
    assert calls == [1, 2] and not wrapped.active
    assert sum("running it eagerly" in r.getMessage() for r in caplog.records) == 1


def _recording_compile(monkeypatch, fail_above: int | None = None) -> list:
    """torch.compile replaced by the function itself, recording each call's input shape (and
    running out of memory above `fail_above` rows)."""
    seen = []

    def fake_compile(fn, **kwargs):
        def compiled(model, batch, *rest):
            seen.append((tuple(batch.shape), *rest))
            if fail_above is not None and batch.shape[0] > fail_above:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
            return fn(model, batch, *rest)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    return seen


def test_a_compiled_model_sees_the_full_batch_shape_and_gives_back_its_rows(tiny_estimator, coco_src, monkeypatch):
    """A partial batch reaches the compiled towers padded with zero rows to the most rows seen - the
    text batch before it is cut into groups, so its groups have the full batch's rows too; only its
    own rows come back, as eager computes them."""
    seen = _recording_compile(monkeypatch)
    torch.manual_seed(0)
    compiled = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", compile=True)
    pixels = _coco_pixels(tiny_estimator, coco_src, 6)
    words = "a large red star above a small blue circle on a green background near the top left corner".split()
    texts = tiny_estimator.preparer.collate("text", [" ".join(words[: 1 + (i * 5) % len(words)]) for i in range(300)])
    for rows in (6, 4):
        torch.testing.assert_close(compiled.encode("image", pixels[:rows]), tiny_estimator.encode("image", pixels[:rows]),
                                   atol=1e-6, rtol=0)
    assert [shape[0] for shape, *_ in seen] == [6, 6]
    seen.clear()
    for rows in (300, 200):
        part = take_rows(texts, slice(0, rows))
        torch.testing.assert_close(compiled.encode("text", part), tiny_estimator.encode("text", part), atol=1e-6, rtol=0)
    assert [shape[0] for shape, *_ in seen] == [150] * 4  # 2 groups of 150 each time, not one of 200
    assert all(length in (16, 32) for _, length in seen)


def test_a_compiled_model_pads_to_the_smaller_chunks_after_running_out_of_memory(tiny_estimator, coco_src, monkeypatch):
    """After an out-of-memory the caller (OomBackoff) goes on in halves: padding them back up to
    the batch that did not fit would run out again."""
    seen = _recording_compile(monkeypatch, fail_above=4)
    torch.manual_seed(0)
    compiled = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", compile=True)
    pixels = _coco_pixels(tiny_estimator, coco_src, 8)
    backoff = OomBackoff()
    out = backoff(lambda part: compiled.encode("image", part), pixels)
    torch.testing.assert_close(out, tiny_estimator.encode("image", pixels), atol=1e-6, rtol=0)
    assert [shape[0] for shape, *_ in seen] == [8, 4, 4] and backoff.chunk == 4


def test_a_tower_that_fails_to_compile_runs_eager_cuts_and_no_padding(monkeypatch, caplog):
    monkeypatch.setattr(torch, "compile", _failing_compile)
    compiled = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", compile=True)
    assert compiled.text_cuts == TextCuts(buckets=4, step=16)
    tokens = compiled.tokenizer(["a dog", "x", "two cats"])
    compiled.encode("text", tokens)
    assert compiled.text_cuts == TextCuts(buckets=4, step=1) and compiled.padding.rows == {"text": 3}
    compiled.encode("text", tokens[:2])
    assert compiled.padding.rows == {"text": 3}  # no longer padded: the eager tower takes any shape


def test_compiled_text_cuts_in_steps_stay_exact(tiny_estimator):
    """Rounding each bucket's cut up to a step (fewer shapes for a compiled tower) changes no output."""
    from pairclean.backends.text_trim import bucketed_encode_text

    captions = ["a dog", "two people riding horses along a beach at sunset", "x", "a red circle"] * 80
    tokens = tiny_estimator.tokenizer(captions)
    ends = token_ends(tokens)
    lengths = []

    def encode(model, text, length):
        lengths.append(length)
        return trimmed_encode_text(model, text, length)

    plain = bucketed_encode_text(tiny_estimator.model, tokens, ends)
    stepped = bucketed_encode_text(tiny_estimator.model, tokens, ends, encode=encode, cuts=TextCuts(step=16))
    assert set(lengths) <= {16, 32} and len(lengths) == 2
    torch.testing.assert_close(stepped, plain, atol=2e-6, rtol=0)


@pytest.mark.slow
def test_real_torch_compile_encodes_like_eager(tiny_estimator, coco_src):
    """Inductor on this machine's C++ compiler (minutes on 2 cores, so slow-marked); if it cannot
    compile, the estimator still encodes (eagerly) and says so once."""
    torch.manual_seed(0)
    compiled = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", compile=True)
    pixels = _coco_pixels(tiny_estimator, coco_src, 4)
    tokens = tiny_estimator.tokenizer(["a red circle", "two people riding horses along a beach", "x", "a dog"])
    torch.testing.assert_close(compiled.encode("image", pixels), tiny_estimator.encode("image", pixels), atol=1e-4, rtol=0)
    torch.testing.assert_close(compiled.encode("text", tokens), tiny_estimator.encode("text", tokens), atol=1e-4, rtol=0)
    torch.testing.assert_close(compiled.encode("text", tokens[:2]), tiny_estimator.encode("text", tokens[:2]), atol=1e-4, rtol=0)
    torch.testing.assert_close(compiled.encode("image", pixels[:3]), tiny_estimator.encode("image", pixels[:3]), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_towers_compile_once_across_partial_batches(tiny_estimator, coco_src):
    """A group's last, partial batch and captions of other lengths reuse the towers' first
    compilation (padded rows, cuts in steps): no recompilation (on CUDA: no further CUDA graph)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    compiled = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", compile=True)
    pixels = _coco_pixels(tiny_estimator, coco_src, 6)
    short = tiny_estimator.tokenizer(["a dog", "x", "a red circle", "two cats", "a cup", "tea"])
    long = tiny_estimator.tokenizer(["two people riding horses along a beach at sunset while a dog runs"] * 5)
    torch._dynamo.reset()
    counters.clear()
    compiled.encode("image", pixels)
    compiled.encode("text", short)
    first = counters["stats"]["unique_graphs"]
    for rows in (5, 2):
        torch.testing.assert_close(compiled.encode("image", pixels[:rows]), tiny_estimator.encode("image", pixels[:rows]),
                                   atol=1e-4, rtol=0)
    torch.testing.assert_close(compiled.encode("text", long), tiny_estimator.encode("text", long), atol=1e-4, rtol=0)
    torch.testing.assert_close(compiled.encode("text", short[:3]), tiny_estimator.encode("text", short[:3]), atol=1e-4, rtol=0)
    assert first >= 2 and counters["stats"]["unique_graphs"] == first
