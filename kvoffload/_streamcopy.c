/*
 * kvoffload._streamcopy: one call that runs a batch of host-memory copies with
 * non-temporal (streaming) stores, the GIL released for the whole batch.
 *
 * Why: a copy larger than the last-level cache gains nothing from leaving its
 * destination in cache, and ordinary stores first read every destination line
 * (read-for-ownership), one more pass over memory. glibc's memmove streams its
 * stores only above a size threshold (192 MiB on the machine this was measured on),
 * which one whole copy crosses and a 64 KiB piece of a KV block never does: the
 * pieces then cost three passes over memory against the whole copy's two.
 *
 * copy_at(address, count): ``count`` rows of int64 (dst, src, nbytes) at ``address``
 * (a contiguous CPU tensor the caller keeps alive), the ranges distinct (no overlap
 * between a source and a destination). On x86-64 the
 * bulk of each copy is written with 16-byte streaming stores (SSE2, part of every
 * x86-64 CPU) and an sfence ends the batch, so the bytes are visible to any thread
 * that learns of the copy's end afterwards. Elsewhere it is memcpy (STREAMING = 0).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#include <xmmintrin.h>
#define KVO_STREAMING 1
#else
#define KVO_STREAMING 0
#endif

/* Below this a copy is not worth the alignment head and tail. */
#define KVO_SMALL 256u

static void copy_one(char *dst, const char *src, size_t n)
{
#if KVO_STREAMING
    if (n < KVO_SMALL) {
        memcpy(dst, src, n);
        return;
    }
    size_t head = (size_t)(-(uintptr_t)dst) & 63u;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63u;
    for (size_t i = 0; i < body; i += 64) {
        _mm_prefetch(src + i + 512, _MM_HINT_T0);
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *streamcopy_copy_at(PyObject *self, PyObject *args)
{
    unsigned long long address;
    Py_ssize_t count;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kn:copy_at", &address, &count)) {
        return NULL;
    }
    if (count < 0 || (count > 0 && address == 0)) {
        PyErr_Format(PyExc_ValueError, "copy_at needs a table and count >= 0, got count %zd",
                     count);
        return NULL;
    }
    const int64_t *seg = (const int64_t *)(uintptr_t)address;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (seg[3 * i + 2] < 0) {
            PyErr_Format(PyExc_ValueError, "segment %zd has a negative size %lld", i,
                         (long long)seg[3 * i + 2]);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        copy_one((char *)(intptr_t)seg[3 * i], (const char *)(intptr_t)seg[3 * i + 1],
                 (size_t)seg[3 * i + 2]);
    }
#if KVO_STREAMING
    _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef streamcopy_methods[] = {
    {"copy_at", streamcopy_copy_at, METH_VARARGS,
     "copy_at(address, count): run count int64 (dst, src, nbytes) rows at address."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef streamcopy_module = {
    PyModuleDef_HEAD_INIT, "_streamcopy",
    "Batched host-memory copies with non-temporal stores.", -1, streamcopy_methods,
};

PyMODINIT_FUNC PyInit__streamcopy(void)
{
    PyObject *m = PyModule_Create(&streamcopy_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "STREAMING", KVO_STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
