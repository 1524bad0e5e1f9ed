import pytest
import torch

from mm_data_text.packing import IGNORE_INDEX, pack_documents


def test_blocks_positions_and_boundary_labels():
    stream = pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], seq_len=4, eos_id=0)
    # stream: 1 2 3 0 | 4 5 0 6 | 7 8 9 10 | 0 (dropped)
    assert len(stream) == 3
    b0, b1, b2 = stream.block(0), stream.block(1), stream.block(2)
    assert b0["input_ids"].tolist() == [1, 2, 3, 0]
    assert b0["position_ids"].tolist() == [0, 1, 2, 3]
    assert b0["labels"].tolist() == [1, 2, 3, 0]
    assert b1["input_ids"].tolist() == [4, 5, 0, 6]
    assert b1["position_ids"].tolist() == [0, 1, 2, 0]
    assert b1["labels"].tolist() == [4, 5, 0, IGNORE_INDEX]
    # a block that starts mid-document counts positions from 0 and keeps all labels
    assert b2["input_ids"].tolist() == [7, 8, 9, 10]
    assert b2["position_ids"].tolist() == [0, 1, 2, 3]
    assert b2["labels"].tolist() == [7, 8, 9, 10]
    assert all(v.dtype == torch.long for v in b1.values())
    with pytest.raises(IndexError):
        stream.block(3)


def test_no_shifted_label_crosses_a_document():
    gen = torch.Generator().manual_seed(0)
    docs = [
        torch.randint(1, 50, (int(n),), generator=gen).tolist()
        for n in torch.randint(1, 12, (40,), generator=gen)
    ]
    stream = pack_documents(docs, seq_len=16, eos_id=0)
    doc_of_token = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor([len(d) + 1 for d in docs]))
    for i in range(len(stream)):
        block = stream.block(i)
        docs_here = doc_of_token[i * 16 : (i + 1) * 16]
        shifted = block["labels"][1:]
        keep = shifted != IGNORE_INDEX
        # wherever position t predicts token t+1, both tokens are in the same document ...
        assert torch.equal(docs_here[:-1][keep], docs_here[1:][keep])
        # ... and every same-document pair is trained
        assert torch.equal(keep, docs_here[:-1] == docs_here[1:])
        # positions restart exactly at document starts
        expected = torch.zeros(16, dtype=torch.long)
        for t in range(1, 16):
            expected[t] = expected[t - 1] + 1 if docs_here[t] == docs_here[t - 1] else 0
        assert torch.equal(block["position_ids"], expected)


def test_without_eos_and_empty():
    stream = pack_documents([[1, 2], [], [3, 4]], seq_len=2, eos_id=None)
    assert len(stream) == 2
    assert stream.block(1)["position_ids"].tolist() == [0, 1]
    assert len(pack_documents([], seq_len=4, eos_id=0)) == 0
