/* The error table, the per-thread detail buffer and small string helpers. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define AFS_ERR_ROW(name, value, text) {value, #name, text},
static const struct {
    int32_t code;
    const char *name;
    const char *text;
} error_table[] = {AFS_ERROR_TABLE(AFS_ERR_ROW)};
#undef AFS_ERR_ROW

/* The provider ABI's return codes (afabric_provider.h) are this table's numbers. */
#define AFS_SAME_AS_AFP(name, value, text) \
    _Static_assert((int)AFP_##name == (int)AFS_##name, "AFP_" #name " must equal AFS_" #name);
AFS_ERROR_TABLE(AFS_SAME_AS_AFP)
#undef AFS_SAME_AS_AFP

#define ERROR_COUNT ((int32_t)(sizeof(error_table) / sizeof(error_table[0])))

/* Detail of the last failure on this thread; Python reads it right after the call. */
static _Thread_local char last_error[512];

uint32_t afs_abi_version(void) { return AFS_ABI_VERSION; }

int32_t afs_error_count(void) { return ERROR_COUNT; }

int32_t afs_error_info(int32_t index, int32_t *code, const char **name, const char **text)
{
    if (index < 0 || index >= ERROR_COUNT || !code || !name || !text)
        return AFS_EINVAL;
    *code = error_table[index].code;
    *name = error_table[index].name;
    *text = error_table[index].text;
    return 0;
}

const char *afs_error_name(int code)
{
    for (int32_t i = 0; i < ERROR_COUNT; i++)
        if (error_table[i].code == code)
            return error_table[i].name;
    return "EUNKNOWN";
}

const char *afs_last_error(void) { return last_error; }

void afs_clear_error(void) { last_error[0] = '\0'; }

int afs_fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
    return code;
}

char *afs_strdup_printf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0)
        return NULL;
    char *s = malloc((size_t)n + 1);
    if (!s)
        return NULL;
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return s;
}

void afs_text_free(uint64_t text) { free((void *)(uintptr_t)text); }
