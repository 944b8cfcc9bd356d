/* io_uring reads for scripts/probe-load-mechanisms.py: the file read front to back in blocks
into a pool of `depth` buffers, `depth` reads in flight, through the raw system calls (no
liburing needed). Options are those of InstantTensor's buffered backend: IOSQE_ASYNC (the kernel
runs each read on a worker thread of its own, so page-cache copies run in parallel) and fixed
buffers (registered with the ring: READ_FIXED). Open the file with O_DIRECT for cold reads that
skip the page cache. Build: cc -O2 -shared -fPIC -o probe_uring.so probe_uring.c */

#include <errno.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_size, cq_size, sqes_size;
};

static void ring_close(struct ring *r)
{
    if (r->sqes)
        munmap(r->sqes, r->sqes_size);
    if (r->cq_map && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_size);
    if (r->sq_map)
        munmap(r->sq_map, r->sq_size);
    close(r->fd);
}

static int ring_open(struct ring *r, unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    memset(r, 0, sizeof *r);
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0)
        return -errno;
    r->sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP)
        r->sq_size = r->cq_size = r->sq_size > r->cq_size ? r->sq_size : r->cq_size;
    r->sq_map = mmap(0, r->sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) {
        r->sq_map = 0;
        ring_close(r);
        return -ENOMEM;
    }
    r->cq_map = (p.features & IORING_FEAT_SINGLE_MMAP)
                    ? r->sq_map
                    : mmap(0, r->cq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
    r->sqes_size = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(0, r->sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->cq_map == MAP_FAILED || r->sqes == MAP_FAILED) {
        if (r->cq_map == MAP_FAILED)
            r->cq_map = 0;
        if (r->sqes == MAP_FAILED)
            r->sqes = 0;
        ring_close(r);
        return -ENOMEM;
    }
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
}

/* Queue one read of [off, off + len) into slot's buffer (the ring has room: depth <= entries). */
static void queue_read(struct ring *r, int fd, char *buf, unsigned slot, int64_t off, unsigned len, int fixed,
                       int async)
{
    unsigned tail = *r->sq_tail, index = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[index];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = fixed ? IORING_OP_READ_FIXED : IORING_OP_READ;
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)buf;
    sqe->len = len;
    sqe->off = (uint64_t)off;
    sqe->buf_index = fixed ? (uint16_t)slot : 0;
    sqe->flags = async ? IOSQE_ASYNC : 0;
    sqe->user_data = slot;
    r->sq_array[index] = index;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* Read `total` bytes of fd from offset 0 in blocks of `block` bytes into the `depth` buffers at
   base + slot * block, `depth` reads in flight. Returns the bytes read (less than total where
   the file ends), or -errno. info[0]: 1 where the buffers were registered (fixed), else 0. */
int64_t uring_read(int fd, char *base, int depth, int64_t block, int64_t total, int fixed, int async, int64_t *info)
{
    struct ring r;
    int status = ring_open(&r, (unsigned)depth);
    if (status < 0)
        return status;
    info[0] = 0;
    if (fixed) {
        struct iovec iov[1024];
        if (depth > 1024) {
            ring_close(&r);
            return -EINVAL;
        }
        for (int i = 0; i < depth; i++) {
            iov[i].iov_base = base + (int64_t)i * block;
            iov[i].iov_len = (size_t)block;
        }
        if (syscall(__NR_io_uring_register, r.fd, IORING_REGISTER_BUFFERS, iov, depth) == 0)
            info[0] = 1;
        else
            fixed = 0;  /* not registered (memlock limit, or not allowed): plain reads */
    }
    int64_t next = 0, done = 0;
    int64_t wanted[1024], at[1024], first[1024];  /* per slot: bytes asked, at which file offset, its block's */
    unsigned inflight = 0;
    for (int s = 0; s < depth && next < total; s++) {
        wanted[s] = total - next < block ? total - next : block;
        at[s] = first[s] = next;
        queue_read(&r, fd, base + (int64_t)s * block, (unsigned)s, next, (unsigned)wanted[s], fixed, async);
        next += wanted[s];
        inflight++;
    }
    unsigned submit = inflight;
    while (inflight) {
        int n = (int)syscall(__NR_io_uring_enter, r.fd, submit, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            status = -errno;
            break;
        }
        submit = 0;
        unsigned head = *r.cq_head, tail = __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            struct io_uring_cqe *cqe = &r.cqes[head & *r.cq_mask];
            unsigned s = (unsigned)cqe->user_data;
            int res = cqe->res;
            inflight--;
            if (res < 0) {
                status = res;
                continue;
            }
            done += res;
            if (res > 0 && res < wanted[s]) {  /* a short read: ask for the rest */
                at[s] += res;
                wanted[s] -= res;
                queue_read(&r, fd, base + (int64_t)s * block + (at[s] - first[s]), s, at[s], (unsigned)wanted[s],
                           0, async);
                submit++;
                inflight++;
            } else if (res > 0 && next < total && status == 0) {
                wanted[s] = total - next < block ? total - next : block;
                at[s] = first[s] = next;
                queue_read(&r, fd, base + (int64_t)s * block, s, next, (unsigned)wanted[s], fixed, async);
                next += wanted[s];
                submit++;
                inflight++;
            }
        }
        __atomic_store_n(r.cq_head, head, __ATOMIC_RELEASE);
    }
    ring_close(&r);
    return status < 0 ? status : done;
}
