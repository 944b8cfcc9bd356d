/* One I/O thread's part of a hot load into a GPU, without the interpreter lock.

A load from the page cache is bound by memory copies; its 16 I/O threads in Python each hold
the interpreter lock for the bookkeeping of every chunk, and queue behind one another for it
(docs/benchmarks.md, "Where a hot GPU load's time goes"). Here one call moves a thread's whole
range of chunks: per chunk, wait for the copies that last read the staging buffer, read the
chunk into it, queue its parts' host-to-device copies, record the buffer's event. The CUDA
calls are function pointers given by the caller (the runtime torch loaded, or the test suite's
simulated GPU), so this file needs no CUDA headers. Python calls it through ctypes; the module
it also defines is empty, there so that importing the extension by its name works.

Built by setup.py as an optional extension; where it is missing, the engine's Python loop runs
(ckptstream/_engine/hotloop.py). */

#include <Python.h>  /* only for the module's import (below): the loop itself is plain C */
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

typedef int (*memcpy_async_fn)(void *dst, const void *src, size_t n, int kind, void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*synchronize_fn)(void *event);

enum { HOT_OK = 0, HOT_STOPPED = 1, HOT_READ_ERROR = 2, HOT_SHORT = 3, HOT_COPY_ERROR = 4, HOT_WAIT_ERROR = 5,
       HOT_RECORD_ERROR = 6 };
enum { H2D = 1 };               /* cudaMemcpyHostToDevice */
enum { CHUNK = 5, PART = 3 };   /* int64 fields per chunk and per part, as hotloop.py lays them out */

/* chunks[CHUNK * c]: file offset, offset in the staging buffer, bytes to read, bytes the chunk
   needs (a shorter read means the file ends early), its first part; chunk c + 1's first part
   ends chunk c's parts (a last entry, nchunks + 1 of them in all). parts[PART * p]: offset in
   the staging buffer, device address, bytes. The chunks take the nbuf buffers in turn; events[b]
   marks the copies out of buffer b. On failure info[0] holds the chunk, info[1] the errno, the
   CUDA status or the file position where the file ended. *done counts the bytes moved. */
int hot_load(int fd, char *const *bufs, void *const *events, int nbuf, int64_t nchunks, const int64_t *chunks,
             const int64_t *parts, memcpy_async_fn memcpy_async, record_fn record, synchronize_fn synchronize,
             void *stream, const volatile int32_t *stop, int64_t *done, int64_t *info)
{
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t *ch = chunks + CHUNK * c;
        int b = (int)(c % nbuf);
        int status;
        info[0] = c;
        if (*stop)
            return HOT_STOPPED;
        if (c >= nbuf && (status = synchronize(events[b])) != 0) {  /* the buffer's last copies are done */
            info[1] = status;
            return HOT_WAIT_ERROR;
        }
        char *buf = bufs[b] + ch[1];
        int64_t got = 0;
        while (got < ch[2]) {
            ssize_t n = pread(fd, buf + got, (size_t)(ch[2] - got), (off_t)(ch[0] + got));
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                info[1] = errno;
                return HOT_READ_ERROR;
            }
            if (n == 0)
                break;
            got += n;
        }
        if (got < ch[3]) {
            info[1] = ch[0] + got;
            return HOT_SHORT;
        }
        for (int64_t p = ch[4]; p < chunks[CHUNK * (c + 1) + 4]; p++) {
            const int64_t *pt = parts + PART * p;
            status = memcpy_async((void *)(uintptr_t)pt[1], bufs[b] + pt[0], (size_t)pt[2], H2D, stream);
            if (status != 0) {
                info[1] = status;
                return HOT_COPY_ERROR;
            }
        }
        if ((status = record(events[b], stream)) != 0) {
            info[1] = status;
            return HOT_RECORD_ERROR;
        }
        *done += ch[3];
    }
    return HOT_OK;
}

static struct PyModuleDef hotloop_module = {PyModuleDef_HEAD_INIT, "_hotloop",
                                            "The hot-load loop, called through ctypes (hotloop.py).", -1, NULL};

PyMODINIT_FUNC PyInit__hotloop(void)
{
    return PyModule_Create(&hotloop_module);
}
