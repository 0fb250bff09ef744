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
 * between a source and a destination). On x86-64 the bulk of each copy is written with
 * streaming stores, 32 bytes wide where the CPU has AVX2 (checked at import) and 16 bytes
 * (SSE2, part of every x86-64 CPU) otherwise, and an sfence ends the batch, so the bytes
 * are visible to any thread that learns of the copy's end afterwards. Elsewhere it is
 * memcpy (STREAMING = 0).
 *
 * copy_claim(address, count, chunk_bytes, state_address, stream): the same table shared by
 * several threads, each calling this with the same arguments. The table's bytes, in row
 * order, are cut into chunks of ``chunk_bytes``; each call claims the next chunk from a
 * counter (``state[0]``, an int64 the caller keeps alive, zero at first), copies it,
 * counts it done (``state[1]``) and claims again until none is left, so a thread that
 * starts late or loses its core copies less instead of holding the others up (equal
 * shares fixed up front end when the slowest thread ends). Returns ``(chunks, last)``:
 * how many chunks this call copied, and whether it finished the copy's last chunk (then
 * every byte is written and visible: each chunk ends with an sfence before it is counted).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(_MSC_VER)
#include <intrin.h>
#define KVO_FETCH_ADD(p) _InterlockedExchangeAdd64((volatile long long *)(p), 1)
#else
#define KVO_FETCH_ADD(p) __atomic_fetch_add((p), 1, __ATOMIC_ACQ_REL)
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#include <xmmintrin.h>
#define KVO_STREAMING 1
#else
#define KVO_STREAMING 0
#endif

#if KVO_STREAMING && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVO_HAVE_AVX2 1
#else
#define KVO_HAVE_AVX2 0
#endif

/* Below this a copy is not worth the alignment head and tail. */
#define KVO_SMALL 256u

static void copy_plain(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}

/* Whether copy_one uses 32-byte stores: the CPU has AVX2 (checked at import; use_avx2()). */
static int kvo_avx2 = 0;

#if KVO_HAVE_AVX2
/* The bulk of a copy in 128-byte steps of 32-byte streaming stores, dst 64-byte aligned;
 * returns the bytes copied. Measured on the machine of docs/benchmarks.md: 64 KiB pieces
 * copied this way ran at 0.94-1.00 of glibc's streaming memmove of the whole 512 MiB on
 * one thread, against 0.84-0.88 with 16-byte stores. */
__attribute__((target("avx2"))) static size_t stream_avx2(char *dst, const char *src, size_t n)
{
    size_t body = n & ~(size_t)127u;
    for (size_t i = 0; i < body; i += 128) {
        _mm_prefetch(src + i + 512, _MM_HINT_T0);
        _mm_prefetch(src + i + 576, _MM_HINT_T0);
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    return body;
}
#endif

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
#if KVO_HAVE_AVX2
    if (kvo_avx2) {
        size_t wide = stream_avx2(dst, src, n);
        dst += wide;
        src += wide;
        n -= wide;
    }
#endif
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

/* Copy bytes [lo, hi) of the table (its rows' bytes in order; ends[i] is where row i ends). */
static void copy_range(const int64_t *seg, const int64_t *ends, Py_ssize_t count, int64_t lo,
                       int64_t hi, void (*copy)(char *, const char *, size_t))
{
    Py_ssize_t a = 0, b = count; /* the first row that ends after lo */
    while (a < b) {
        Py_ssize_t mid = a + (b - a) / 2;
        if (ends[mid] <= lo) {
            a = mid + 1;
        } else {
            b = mid;
        }
    }
    for (Py_ssize_t i = a; i < count; i++) {
        int64_t start = ends[i] - seg[3 * i + 2];
        if (start >= hi) {
            break;
        }
        int64_t from = lo > start ? lo : start;
        int64_t to = hi < ends[i] ? hi : ends[i];
        if (to > from) {
            copy((char *)(intptr_t)(seg[3 * i] + (from - start)),
                 (const char *)(intptr_t)(seg[3 * i + 1] + (from - start)), (size_t)(to - from));
        }
    }
}

static PyObject *streamcopy_copy_claim(PyObject *self, PyObject *args)
{
    unsigned long long address, state_address;
    Py_ssize_t count;
    long long chunk;
    int stream;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnLKp:copy_claim", &address, &count, &chunk, &state_address,
                          &stream)) {
        return NULL;
    }
    if (count < 0 || (count > 0 && address == 0) || chunk < 1 || state_address == 0) {
        PyErr_Format(PyExc_ValueError,
                     "copy_claim needs a table, count >= 0, chunk_bytes >= 1 and a state, got "
                     "count %zd, chunk_bytes %lld",
                     count, chunk);
        return NULL;
    }
    const int64_t *seg = (const int64_t *)(uintptr_t)address;
    int64_t *state = (int64_t *)(uintptr_t)state_address;
    int64_t *ends = PyMem_Malloc(sizeof(int64_t) * (size_t)(count > 0 ? count : 1));
    if (ends == NULL) {
        return PyErr_NoMemory();
    }
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (seg[3 * i + 2] < 0) {
            PyMem_Free(ends);
            PyErr_Format(PyExc_ValueError, "segment %zd has a negative size %lld", i,
                         (long long)seg[3 * i + 2]);
            return NULL;
        }
        total += seg[3 * i + 2];
        ends[i] = total;
    }
    int64_t chunks = total / chunk + (total % chunk != 0);
    int64_t mine = 0;
    int last = 0;
    void (*copy)(char *, const char *, size_t) = stream ? copy_one : copy_plain;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        int64_t k = KVO_FETCH_ADD(&state[0]);
        if (k >= chunks) {
            break;
        }
        int64_t lo = k * chunk;
        copy_range(seg, ends, count, lo, lo + chunk < total ? lo + chunk : total, copy);
#if KVO_STREAMING
        if (stream) {
            _mm_sfence(); /* this chunk's bytes are visible before it is counted done */
        }
#endif
        mine++;
        if (KVO_FETCH_ADD(&state[1]) + 1 == chunks) {
            last = 1;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(ends);
    return Py_BuildValue("(LO)", (long long)mine, last ? Py_True : Py_False);
}

static PyObject *streamcopy_use_avx2(PyObject *self, PyObject *args)
{
    int want;
    (void)self;
    if (!PyArg_ParseTuple(args, "p:use_avx2", &want)) {
        return NULL;
    }
    int before = kvo_avx2;
#if KVO_HAVE_AVX2
    kvo_avx2 = want && __builtin_cpu_supports("avx2");
#else
    (void)want;
#endif
    return PyBool_FromLong(before);
}

static PyMethodDef streamcopy_methods[] = {
    {"use_avx2", streamcopy_use_avx2, METH_VARARGS,
     "use_avx2(flag): write with 32-byte stores where the CPU has AVX2 (the default there), "
     "or with 16-byte ones; returns the previous setting. For tests and measurements."},
    {"copy_at", streamcopy_copy_at, METH_VARARGS,
     "copy_at(address, count): run count int64 (dst, src, nbytes) rows at address."},
    {"copy_claim", streamcopy_copy_claim, METH_VARARGS,
     "copy_claim(address, count, chunk_bytes, state_address, stream): copy chunks of a "
     "table shared with other threads until none is left; return (chunks, last)."},
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
#if KVO_HAVE_AVX2
    __builtin_cpu_init();
    kvo_avx2 = __builtin_cpu_supports("avx2");
#endif
    if (PyModule_AddIntConstant(m, "STREAMING", KVO_STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
