"""What `data.shards` names: a folder, a numbered range, `{a,b}` alternatives, a glob, a comma
list of any of those (commas inside braces belong to the pattern), and `shard_spec`, which writes
a list of paths back as one such spec."""

import pytest

from moevlm.data.errors import DataSetupError
from moevlm.data.reader import expand_shards, shard_spec


def test_shard_specs(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    names = [d / f"s-{i:03d}.tar" for i in range(4)] + [d / "x.tar", d / "y.tar"]
    for p in names:
        p.write_bytes(b"")
    s = [str(p) for p in names]
    assert expand_shards(str(d)) == sorted(s)
    assert expand_shards(f"{d}/s-{{000..002}}.tar") == s[:3]
    # braces with commas in a comma list: the list splits only outside braces
    assert expand_shards(f"{d}/{{x,y}}.tar,{d}/s-003.tar") == [s[4], s[5], s[3]]
    assert expand_shards(f" {d}/s-00[12].tar , ,{d}/x.tar") == [s[1], s[2], s[4]]
    for paths in (s[:4], [s[5], s[4]], s[1:3]):
        assert expand_shards(shard_spec(paths)) == paths
    assert shard_spec(s[:4]) == f"{d}/s-{{000..003}}.tar"
    with pytest.raises(DataSetupError, match="names no folder or file"):
        expand_shards(f"{d}/{{p,q}}.tar")
