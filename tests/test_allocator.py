"""The caching-allocator model: pools per stream, record_stream's deferred frees and the PYTORCH_CUDA_ALLOC_CONF
settings, each on a block sequence whose bytes are worked out by hand from PyTorch's rules
(c10/cuda/CUDACachingAllocator.cpp); then the same rules on the simulated device, fed by real CPU allocations."""

from __future__ import annotations

import pytest
import torch
from simcuda import simulated_cuda

from lightning_memtenants.predict.allocator import AllocatorSettings, CachingAllocatorModel, round_size

MiB = 1 << 20


class Streams:
    """The current stream, as the model reads it at each malloc."""

    def __init__(self) -> None:
        self.now = "default"

    def __call__(self) -> str:
        return self.now


def state(model: CachingAllocatorModel) -> tuple[int, int, int]:
    return model.reserved_bytes, model.allocated_bytes, model.segments


def test_a_block_freed_on_one_stream_is_not_reused_by_another() -> None:
    streams = Streams()
    model = CachingAllocatorModel(stream=streams)
    streams.now = "A"
    assert model.malloc(1, 12 * MiB) == 12 * MiB  # 10 MiB or more: a segment of exactly 12 MiB (2 MiB steps)
    model.free(1)
    streams.now = "B"
    model.malloc(2, 12 * MiB)  # A's free 12 MiB block is not B's: a second segment
    assert state(model) == (24 * MiB, 12 * MiB, 2)
    assert model.reserved_by_stream() == {"A": 12 * MiB, "B": 12 * MiB}
    streams.now = "A"
    model.malloc(3, 12 * MiB)  # back on A: its own block again, nothing new
    assert state(model) == (24 * MiB, 24 * MiB, 2)
    model.free(2)
    model.free(3)
    assert (model.reserved_peak_bytes, model.allocated_peak_bytes) == (24 * MiB, 24 * MiB)


def test_the_same_stream_reuses_its_blocks_small_and_large_pools_apart() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 4 * MiB)  # 1 to 10 MiB: a 20 MiB segment, split (16 MiB left)
    model.malloc(2, 100)  # the small pool: a 2 MiB segment; the large pool's free 16 MiB is not for it
    assert state(model) == (22 * MiB, 4 * MiB + 512, 2)
    model.free(1)
    assert model.malloc(3, 6 * MiB) == 6 * MiB  # the freed 4 MiB merged back: 20 MiB free, split again
    assert state(model) == (22 * MiB, 6 * MiB + 512, 2)
    assert model.reserved_by_stream() == {None: 22 * MiB}  # no stream callable: one default stream


def test_record_stream_defers_the_free_until_that_stream_is_synchronized() -> None:
    streams = Streams()
    model = CachingAllocatorModel(stream=streams)
    streams.now = "A"
    model.malloc(1, 12 * MiB)
    model.record_stream(1, "A")  # its own stream: no event, ignored as torch ignores it
    model.record_stream(1, "B")  # used on B: the free waits for B's work
    model.free(1)
    assert state(model) == (12 * MiB, 0, 1)  # allocated drops at the free, as CUDA's counter does
    model.malloc(2, 12 * MiB)  # the block is not free yet: a second segment
    assert state(model) == (24 * MiB, 12 * MiB, 2)
    model.synchronize("C")  # another stream's events: nothing changes
    model.malloc(3, 12 * MiB)
    assert state(model) == (36 * MiB, 24 * MiB, 3)
    model.synchronize("B")  # B's event completes: block 1 is free on A
    model.malloc(4, 12 * MiB)
    assert state(model) == (36 * MiB, 36 * MiB, 3)
    model.record_stream(4, "B")
    model.free(4)
    model.synchronize()  # the whole device: every event completes
    model.malloc(5, 12 * MiB)
    assert state(model) == (36 * MiB, 36 * MiB, 3)


def test_empty_cache_releases_whole_free_segments_after_the_events() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 12 * MiB)
    model.malloc(2, 4 * MiB)  # a 20 MiB segment, 16 MiB of it free
    model.malloc(3, 30 * MiB)
    model.record_stream(3, "side")
    model.free(1)
    model.free(3)  # waits for "side": empty_cache synchronizes first, as torch's release_cached_blocks does
    model.empty_cache()  # the 12 and 30 MiB segments go; the 20 MiB one is split (block 2 lives), so it stays
    assert state(model) == (20 * MiB, 4 * MiB, 1)
    assert model.reserved_peak_bytes == 62 * MiB


def test_expandable_segments_map_pages_and_a_free_block_at_the_end_grows() -> None:
    plain = CachingAllocatorModel()
    expandable = CachingAllocatorModel(AllocatorSettings(expandable_segments=True))
    for model in (plain, expandable):
        model.malloc(1, 3 * MiB)
        model.malloc(2, 5 * MiB)
    # the large pool's pages are 20 MiB (kLargeBuffer), as big as the segment a 1-10 MiB request gets: no difference
    assert state(plain) == (20 * MiB, 8 * MiB, 1)
    assert state(expandable) == (20 * MiB, 8 * MiB, 1)

    plain, expandable = CachingAllocatorModel(), CachingAllocatorModel(AllocatorSettings(expandable_segments=True))
    for model in (plain, expandable):
        model.malloc(1, 25 * MiB)
        model.free(1)
        model.malloc(2, 45 * MiB)
    # plain: 25 MiB rounds to a 26 MiB segment, too small for 45 MiB, which gets its own 46 MiB one
    assert state(plain) == (72 * MiB, 46 * MiB, 2)
    # expandable: 25 MiB maps two 20 MiB pages; freed, that block sits before unmapped space, so 45 MiB maps one
    # more page after it and takes the first 45 MiB of the 60; one segment, reserved in whole pages
    assert state(expandable) == (60 * MiB, 45 * MiB, 1)
    assert expandable.reserved_peak_bytes == 60 * MiB

    model = CachingAllocatorModel(AllocatorSettings(expandable_segments=True))
    model.malloc(1, 25 * MiB)
    model.malloc(2, 25 * MiB)  # the 15 MiB left of two pages and one page more: 60 MiB mapped
    model.malloc(3, 1000)  # the small pool has its own segment, in 2 MiB pages
    assert state(model) == (62 * MiB, 50 * MiB + 1024, 2)
    model.free(1)
    assert model.reserved_bytes == 62 * MiB  # a free never unmaps
    model.empty_cache()  # the free bytes 0-25 MiB hold one whole page (0-20 MiB): unmapped; 50-60 MiB shares a page
    assert state(model) == (42 * MiB, 25 * MiB + 1024, 2)
    model.free(2)
    model.free(3)
    model.empty_cache()  # nothing used is left: every page unmapped, both segments released
    assert state(model) == (0, 0, 0)
    assert model.reserved_peak_bytes == 62 * MiB


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    model = CachingAllocatorModel(AllocatorSettings.parse("max_split_size_mb:64"))
    model.malloc(1, 100 * MiB)
    model.free(1)
    model.malloc(2, 30 * MiB)  # below 64 MiB: the free 100 MiB block is oversize, not for it
    assert state(model) == (130 * MiB, 30 * MiB, 2)
    model.free(2)
    assert model.malloc(3, 79 * MiB) == 80 * MiB  # 100 >= 79 + 20 (max_non_split_rounding): refused, a new segment
    assert state(model) == (210 * MiB, 80 * MiB, 3)
    assert model.malloc(4, 90 * MiB) == 100 * MiB  # 100 < 90 + 20: taken whole, never split; counted whole
    assert state(model) == (210 * MiB, 180 * MiB, 3)
    default = CachingAllocatorModel()
    default.malloc(1, 100 * MiB)
    default.free(1)
    assert default.malloc(2, 30 * MiB) == 30 * MiB  # without the setting the 100 MiB block is split
    assert state(default) == (100 * MiB, 30 * MiB, 1)


def test_roundup_power2_divisions_round_the_request() -> None:
    four = AllocatorSettings.parse("roundup_power2_divisions:4")
    assert round_size(1200 * MiB, four) == 1280 * MiB  # 1024, 1280, 1536, 1792 between 1 and 2 GiB
    assert round_size(1200 * MiB) == 1200 * MiB
    assert round_size(1024 * MiB, four) == 1024 * MiB  # a power of two stays
    assert round_size(1500, four) == 1536  # below 512 x 4 bytes: 512-byte rounding only
    assert round_size(2049, four) == 2560  # 2048 to 4096 in four steps of 512
    table = AllocatorSettings.parse("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert round_size(300 * MiB, table) == 300 * MiB  # the 256-512 MiB interval: 1 division, no rounding
    assert round_size(100 * MiB, table) == 100 * MiB  # the first entry covers every smaller size too
    assert round_size(600 * MiB, table) == 768 * MiB  # 512 MiB to 1 GiB in 2 steps of 256 MiB
    assert round_size(1200 * MiB, table) == 1280 * MiB  # '>': 4 divisions from 1 GiB up
    model = CachingAllocatorModel(four)
    assert model.malloc(1, 1200 * MiB) == 1280 * MiB
    assert state(model) == (1280 * MiB, 1280 * MiB, 1)


def test_garbage_collection_releases_the_oldest_blocks_and_the_peak_stays() -> None:
    # allowed = 0.8 x 250 MiB = 200 MiB; collection starts above 0.5 x 200 = 100 MiB reserved
    settings = AllocatorSettings.parse("garbage_collection_threshold:0.5,per_process_memory_fraction:0.8")
    model = CachingAllocatorModel(settings, device_bytes=250 * MiB)
    model.malloc(1, 40 * MiB)  # request 1 of the large pool
    model.malloc(2, 12 * MiB)  # request 2
    model.free(1)  # freed at request 2
    model.malloc(3, 60 * MiB)  # request 3: nothing fits; 52 MiB reserved is under 100 MiB, no collection
    assert model.reserved_bytes == 112 * MiB
    model.free(2)  # freed at request 3
    # request 4: nothing fits (40 and 12 MiB are free); 112 MiB > 100 MiB: 12 MiB to release. Ages: block 1 has
    # seen 2 requests, block 2 one; the average is 1.5, so block 1 (40 MiB) goes, which is enough
    model.malloc(4, 50 * MiB)
    assert state(model) == (122 * MiB, 110 * MiB, 3)
    model.free(3)
    model.free(4)  # both freed at request 4
    # request 5: ages 2 (block 2), 1, 1; 122 - 100 = 22 MiB to release: block 2 (12 MiB) first, then the average
    # of the two left is 1 and both go
    model.malloc(5, 70 * MiB)
    assert state(model) == (70 * MiB, 70 * MiB, 1)
    assert model.reserved_peak_bytes == 122 * MiB  # reserved fell; the peak stays
    # torch collects only under a memory fraction below 1: without one the same sequence keeps everything
    idle = CachingAllocatorModel(AllocatorSettings.parse("garbage_collection_threshold:0.5"), device_bytes=250 * MiB)
    for key, nbytes in ((1, 40), (2, 12)):
        idle.malloc(key, nbytes * MiB)
    idle.free(1)
    idle.malloc(3, 60 * MiB)
    idle.free(2)
    idle.malloc(4, 50 * MiB)
    assert idle.reserved_bytes == 162 * MiB


def test_reset_peak_sets_both_peaks_to_now() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 30 * MiB)
    model.free(1)
    model.reset_peak()
    assert (model.reserved_peak_bytes, model.allocated_peak_bytes) == (30 * MiB, 0)


def test_parse_reads_torch_s_syntax() -> None:
    settings = AllocatorSettings.parse(
        " expandable_segments:True, max_split_size_mb:512,garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:[256:1,512:2,>:4],backend:native,release_lock_on_cudamalloc:True,"
        "pinned_use_cuda_host_register:False,pinned_num_register_threads:8"
    )
    assert settings.expandable_segments and settings.max_split_size_mb == 512
    assert settings.garbage_collection_threshold == 0.6
    assert settings.roundup_power2_divisions == tuple((1 << i, 1 if i <= 8 else 2 if i == 9 else 4) for i in range(16))
    assert AllocatorSettings.parse("") == AllocatorSettings() == AllocatorSettings.parse("backend:native")
    assert AllocatorSettings.parse("max_split_size_mb:100,max_split_size_mb:200").max_split_size_mb == 200
    assert AllocatorSettings.parse(settings.conf()) == settings  # conf() writes what parse() reads back
    assert settings.conf() == (
        "expandable_segments:True,max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,>:4],"
        "garbage_collection_threshold:0.6"
    )
    assert AllocatorSettings().describe() == "the caching allocator's defaults"
    assert AllocatorSettings.parse("expandable_segments:True").describe() == (
        "the caching allocator with expandable_segments:True"
    )
    assert "has no effect without a per-process memory fraction" in settings.describe()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("expandable_segments:true", r"expandable_segments must be True or False"),
        ("max_split_size_mb:10", r"max_split_size_mb must be at least 20"),
        ("max_split_size_mb:big", r"max_split_size_mb must be a whole number"),
        ("garbage_collection_threshold:1.5", r"garbage_collection_threshold must be a number strictly between"),
        ("roundup_power2_divisions:3", r"roundup_power2_divisions must be a power of two"),
        ("roundup_power2_divisions:[256:1,300:2]", r"roundup_power2_divisions must be .* \(intervals a power of two\)"),
        ("backend:cudaMallocAsync", r"backend:cudaMallocAsync is CUDA's own stream-ordered allocator"),
        ("expandable_segments", r"expected 'key:value' at 'expandable_segments'"),
        (",max_split_size_mb:30", r"expected 'key:value' at ','"),
        ("max_split_size_mb:30 expandable_segments:True", r"max_split_size_mb must be a whole number"),
        ("max_split_size_mb:30:40", r"expected ',' after max_split_size_mb's value"),
        ("max_split_mb:512", r"unknown key 'max_split_mb'"),
        ("roundup_power2_divisions:[256:1", r"roundup_power2_divisions's list has no closing"),
    ],
)
def test_parse_refuses_what_torch_refuses_in_one_sentence(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=r"^allocator: " + says) as caught:
        AllocatorSettings.parse(text)
    assert "\n" not in str(caught.value)


def test_from_environ_reads_torch_s_variables_in_its_order() -> None:
    assert AllocatorSettings.from_environ({}) == AllocatorSettings()
    cuda = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert AllocatorSettings.from_environ(cuda).expandable_segments
    both = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:200", **cuda}  # the newer variable wins, the other is ignored
    assert AllocatorSettings.from_environ(both) == AllocatorSettings(max_split_size_mb=200)
    assert AllocatorSettings.from_environ({"PYTORCH_ALLOC_CONF": "", **cuda}) == AllocatorSettings()
    with pytest.raises(ValueError, match=r"^PYTORCH_CUDA_ALLOC_CONF: expandable_segments must be True or False"):
        AllocatorSettings.from_environ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:yes"})


def test_the_simulated_device_keeps_a_pool_per_cpu_stream() -> None:
    side, other = torch.cpu.Stream(), torch.cpu.Stream()
    with simulated_cuda() as sim:
        with torch.cpu.stream(side):
            a = torch.empty(3 * MiB, dtype=torch.uint8)  # a 20 MiB segment on the side stream
        del a
        assert torch.cuda.memory_reserved() == 20 * MiB and torch.cuda.memory_allocated() == 0
        with torch.cpu.stream(other):
            b = torch.empty(3 * MiB, dtype=torch.uint8)  # the side stream's free block is not this stream's
        assert torch.cuda.memory_reserved() == 40 * MiB
        c = torch.empty(3 * MiB, dtype=torch.uint8)  # the default stream: a third segment
        assert torch.cuda.memory_reserved() == 60 * MiB
        with torch.cpu.stream(side):
            d = torch.empty(5 * MiB, dtype=torch.uint8)  # back on the side stream: its own free 20 MiB block
        assert torch.cuda.memory_reserved() == 60 * MiB
        assert torch.cuda.memory_allocated() == 11 * MiB and torch.cuda.max_memory_reserved() == 60 * MiB
        default = torch.cpu.current_stream()
        assert sim.allocator.reserved_by_stream() == {side: 20 * MiB, other: 20 * MiB, default: 20 * MiB}
        del b, c, d


def test_the_simulated_device_takes_allocator_settings() -> None:
    with simulated_cuda(settings=AllocatorSettings(expandable_segments=True)):
        a = torch.empty(25 * MiB, dtype=torch.uint8)
        del a
        b = torch.empty(45 * MiB, dtype=torch.uint8)  # the free 40 MiB at the segment's end grows by one page
        assert torch.cuda.memory_reserved() == 60 * MiB and torch.cuda.memory_allocated() == 45 * MiB
        del b


def test_the_newer_keys_large_segment_size_and_max_non_split_rounding() -> None:
    model = CachingAllocatorModel(AllocatorSettings.parse("large_segment_size_mb:40"))
    model.malloc(1, 4 * MiB)  # 1 to 10 MiB: a 40 MiB segment instead of 20
    assert state(model) == (40 * MiB, 4 * MiB, 1)
    model = CachingAllocatorModel(AllocatorSettings.parse("max_split_size_mb:64,max_non_split_rounding_mb:40"))
    model.malloc(1, 100 * MiB)
    model.free(1)
    assert model.malloc(2, 79 * MiB) == 100 * MiB  # 100 < 79 + 40: the oversize block serves it, whole
    assert state(model) == (100 * MiB, 100 * MiB, 1)


def test_settings_built_directly_are_checked_too() -> None:
    with pytest.raises(ValueError, match=r"^AllocatorSettings.max_split_size_mb must be None or a whole number"):
        AllocatorSettings(max_split_size_mb=8)
    with pytest.raises(ValueError, match=r"^AllocatorSettings.roundup_power2_divisions must be None, a power of two"):
        AllocatorSettings(roundup_power2_divisions=3)
    assert AllocatorSettings(roundup_power2_divisions=((32768, 2),)) == AllocatorSettings(roundup_power2_divisions=2)
    with pytest.raises(ValueError, match=r"^settings must be an AllocatorSettings or None"):
        CachingAllocatorModel("expandable_segments:True")  # type: ignore[arg-type]
