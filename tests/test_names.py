# SPDX-License-Identifier: Apache-2.0
"""Unit tier: names from outside (node and job names) → subject tokens and file names, injective, property-tested:
any two distinct names give distinct tokens and file names, each is read back, and nothing a name holds can
become a subject separator, a wildcard, a path separator or a hidden file."""
import string

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jobprobe.core.names import FILE_KEEP, MAX_FILE_NAME, SUBJECT_KEEP, escape, job_filename, unescape
from jobprobe.core.wire import MAX_TOKEN, frames_subject, node_of, token

names = st.text(min_size=1, max_size=60)
tricky = st.text(alphabet=string.ascii_letters[:4] + "._-/*> \x00é😀" + "\udc80", min_size=1, max_size=12)


def fits(name: str) -> bool:
    """A name short enough for a subject once escaped (a longer one is refused: the last test)."""
    return len(escape(name, SUBJECT_KEEP)) <= MAX_TOKEN


@settings(max_examples=200, deadline=None)
@given(st.one_of(names, tricky), st.one_of(names, tricky))
def test_two_names_never_share_a_token_or_a_file(a, b):
    if a != b:
        assert job_filename(a) != job_filename(b)
        if fits(a) and fits(b):
            assert token(a) != token(b)


@settings(max_examples=200, deadline=None)
@given(st.one_of(names, tricky))
def test_a_token_reads_back_and_holds_no_separator_or_wildcard(name):
    assume(fits(name))
    tok = token(name)
    assert node_of(tok) == name
    assert set(tok) <= SUBJECT_KEEP | {"_"}
    assert frames_subject(name, name if len(name) < 50 else "j").count(".") == 3


@settings(max_examples=200, deadline=None)
@given(st.one_of(names, tricky))
def test_a_file_name_is_one_visible_path_component(name):
    f = job_filename(name)
    assert "/" not in f and "\x00" not in f and not f.startswith(".") and len(f) <= MAX_FILE_NAME
    assert set(f) <= FILE_KEEP | {"_", "~"}
    if "~" not in f:                        # not shortened: it reads back (a leading `.` is its `_2e`)
        assert unescape("." + f[3:] if f.startswith("_2e") else f, FILE_KEEP) == name


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_what_token_never_makes_is_refused(text):
    try:
        name = node_of(text)
    except ValueError:
        return
    assert token(name) == text


def test_the_documented_examples():
    assert token("gpu.017") == "gpu_2e017" and token("gpu_017") == "gpu_5f017"
    assert job_filename("a/b") == "a_2fb" and job_filename("a_b") == "a_5fb" and job_filename(".x") == "_2ex"
    assert escape("a b", SUBJECT_KEEP) == "a_20b"


@pytest.mark.parametrize("bad", ["", None, 3])
def test_an_empty_or_non_string_name_is_refused(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        token(bad)
    with pytest.raises(ValueError, match="non-empty string"):
        job_filename(bad)


def test_a_node_name_too_long_for_a_subject_is_refused():
    with pytest.raises(ValueError, match="too long"):
        token("é" * MAX_TOKEN)


@settings(max_examples=200, deadline=None)
@given(st.one_of(names, tricky), st.one_of(names, tricky), st.integers(1, 64))
def test_a_subject_reads_back_as_its_partition_job_and_node(node, job, n):
    """frames_subject and the server's mapping (wire.mappings: `jobprobe.part.<partition>.frames.…`) parse back to
    the tokens they were made of; the beat subject too; a subject of neither is refused."""
    from jobprobe.core.wire import PARTS, beat_subject, job_token, parse_subject, partition
    assume(fits(node))
    plain = frames_subject(node, job)
    assert parse_subject(plain) == (None, job_token(job), token(node))
    i = partition(job_token(job), n)
    assert 0 <= i < n
    mapped = f"{PARTS}.{i}.frames.{job_token(job)}.{token(node)}"
    assert parse_subject(mapped) == (i, job_token(job), token(node))
    assert parse_subject(beat_subject(node)) == (None, None, token(node))
    for bad in (f"{PARTS}.{i}.beat.{token(node)}", f"jobprobe.frames.{token(node)}", plain + ".x",
                f"{PARTS}.x.frames.{job_token(job)}.{token(node)}", "jobprobe.ctl.trace"):
        with pytest.raises(ValueError):
            parse_subject(bad)
