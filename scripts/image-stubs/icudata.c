// SPDX-License-Identifier: Apache-2.0
/* libicudata.so.72 for the agent's image: an ICU common data package that holds no data.
 *
 * libxml2 links ICU, and Debian's LLVM links libxml2 (for reading Windows manifests, which bcc never does); the
 * real libicudata is 31 MB of locale and converter tables nothing in the agent looks up. ICU accepts a package
 * with an empty table of contents (a lookup in it finds nothing and says so): the same format as the real one
 * (common/ucmndata.h: a MappedData header, a UDataInfo saying "CmnD" format 1, then the table's count). */
#include <stdint.h>

#ifndef ICU_MAJOR
#define ICU_MAJOR 72
#endif
#define CAT(a, b, c) a##b##c
#define DATA(v) CAT(icudt, v, _dat)

struct package {
    uint16_t header_size;          /* MappedData */
    uint8_t magic1, magic2;
    uint16_t info_size;            /* UDataInfo */
    uint16_t reserved_word;
    uint8_t big_endian, charset_family, sizeof_uchar, reserved_byte;
    uint8_t data_format[4], format_version[4], data_version[4];
    uint8_t pad[8];                /* the header padded to 32 bytes, as ICU's own packages are */
    uint32_t count;                /* the table of contents: no entries */
};

__attribute__((visibility("default"), aligned(16))) const struct package DATA(ICU_MAJOR) = {
    32, 0xda, 0x27,
    20, 0,
    0, 0, 2, 0,                    /* little-endian, ASCII family, 2-byte UChar */
    {'C', 'm', 'n', 'D'}, {1, 0, 0, 0}, {ICU_MAJOR, 1, 0, 0},
    {0}, 0,
};
