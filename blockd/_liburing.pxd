# cython: language_level=3
"""liburing's declarations (Debian liburing-dev, <liburing.h>) for the two compiled modules that
make an io_uring: the host's FUSE ring (``initiator/fuse/_loop.pyx``) and the target's queue
thread (``target/_uring_loop.pyx``); only the fields and calls they use. The SQE's fields sit in
anonymous unions in C, so they are named as C code names them. Both link ``-luring`` (setup.py)."""

from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t


cdef extern from "liburing.h" nogil:
    struct io_uring_sqe:
        uint8_t opcode
        uint8_t flags
        int32_t fd
        uint64_t addr
        uint32_t len
        uint64_t user_data
        int rw_flags  # (a read's or write's RWF_* flags)
        uint32_t cmd_op
        uint8_t cmd[80]
    struct io_uring_cqe:
        uint64_t user_data
        int32_t res
    struct io_uring_sq:
        unsigned* kflags
    struct io_uring:
        int ring_fd
        io_uring_sq sq
    struct io_uring_params:
        uint32_t flags
        uint32_t sq_thread_idle
    struct __kernel_timespec:
        long long tv_sec
        long long tv_nsec
    int io_uring_queue_init(unsigned entries, io_uring* ring, unsigned flags)
    int io_uring_queue_init_params(unsigned entries, io_uring* ring, io_uring_params* p)
    void io_uring_queue_exit(io_uring* ring)
    io_uring_sqe* io_uring_get_sqe(io_uring* ring)
    int io_uring_submit(io_uring* ring)
    int io_uring_submit_and_wait(io_uring* ring, unsigned wait_nr)
    int io_uring_wait_cqe(io_uring* ring, io_uring_cqe** cqe)
    int io_uring_wait_cqes(io_uring* ring, io_uring_cqe** cqe, unsigned wait_nr, __kernel_timespec* ts,
                           void* sigmask)
    int io_uring_submit_and_wait_timeout(io_uring* ring, io_uring_cqe** cqe, unsigned wait_nr,
                                         __kernel_timespec* ts, void* sigmask)
    int io_uring_peek_cqe(io_uring* ring, io_uring_cqe** cqe)
    void io_uring_cqe_seen(io_uring* ring, io_uring_cqe* cqe)
    unsigned io_uring_peek_batch_cqe(io_uring* ring, io_uring_cqe** cqes, unsigned count)
    void io_uring_cq_advance(io_uring* ring, unsigned nr)
    unsigned io_uring_cq_ready(const io_uring* ring)
    void io_uring_prep_read(io_uring_sqe* sqe, int fd, void* buf, unsigned nbytes, unsigned long long offset)
    void io_uring_prep_write(io_uring_sqe* sqe, int fd, const void* buf, unsigned nbytes, unsigned long long offset)
    void io_uring_prep_sendmsg(io_uring_sqe* sqe, int fd, const void* msg, unsigned flags)  # a struct msghdr*
    void io_uring_prep_recv(io_uring_sqe* sqe, int sockfd, void* buf, size_t len, int flags)
    enum:
        IOSQE_IO_LINK
        IOSQE_CQE_SKIP_SUCCESS
        IORING_SETUP_SQE128
        IORING_SETUP_SINGLE_ISSUER
        IORING_SETUP_COOP_TASKRUN
        IORING_SETUP_DEFER_TASKRUN
        IORING_SETUP_SQPOLL
        IORING_SQ_NEED_WAKEUP
        IORING_OP_URING_CMD
