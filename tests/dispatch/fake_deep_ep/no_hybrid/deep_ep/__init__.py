"""TEST DOUBLE, not DeepEP: DeepEP main as the gate sees it, Buffer and ElasticBuffer but no
HybridEPBuffer (see ../../README.md)."""


class _Refuse:
    def __init__(self, *args, **kwargs):
        raise AssertionError("test double: the fake deep_ep classes are never constructed")


class Buffer(_Refuse):
    pass


class ElasticBuffer(_Refuse):
    pass
