# cython: language_level=3
"""Little-endian loads and stores for the compiled data plane, one copy for every ``.pyx``.

NVMe and NVMe/TCP fields are little-endian at unaligned offsets: these read and write them byte
by byte, which gcc -O2 folds into one (unaligned) load or store on x86 and stays correct on a
big-endian or strict-alignment machine. Each module checks the offsets it uses against headers
built by ``protocol/`` at import; these helpers only say how a field of a given width is read.
"""

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef inline uint16_t le16(const uint8_t* p) noexcept nogil:
    return p[0] | (p[1] << 8)


cdef inline uint32_t le32(const uint8_t* p) noexcept nogil:
    return p[0] | (p[1] << 8) | (p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline uint64_t le64(const uint8_t* p) noexcept nogil:
    return le32(p) | (<uint64_t>le32(p + 4) << 32)


cdef inline void st16(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF


cdef inline void st32(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = v >> 24


cdef inline void st64(uint8_t* p, uint64_t v) noexcept nogil:
    st32(p, <uint32_t>v)
    st32(p + 4, <uint32_t>(v >> 32))
