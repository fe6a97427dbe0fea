"""The communication layer's refusals on real gloo ranks: a tensor a group cannot take is
refused naming the caller (device, dtype, layout, receive buffers, ``avg`` of integers).
(The layer read from the sources: tests/unit/test_comm_layer.py.)"""

def test_caller_is_named_on_real_ranks(pools):
    import comm_cases

    messages = pools.run(2, comm_cases.refusals)
    for m in messages:
        assert m["shape"] == "comm_cases.refusals: tensor on meta, group on cpu (gloo)"
        assert m["dtype"].startswith("comm_cases.refusals: tensor of dtype torch.complex64")
        assert m["layout"].startswith("comm_cases.refusals: tensor of shape (3, 4) is not contiguous")
        assert m["p2p"].startswith("comm_cases.refusals: receive buffer for rank")
        assert m["explicit"].startswith("my.caller: ")
        assert m["avg_int"].startswith("comm_cases.refusals: op='avg' needs a floating-point tensor")
