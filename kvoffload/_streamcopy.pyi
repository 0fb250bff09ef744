from array import array

STREAMING: int

def copy(segments: array[int] | memoryview, /) -> None: ...
