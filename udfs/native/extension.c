/* tra_sql's loadable DuckDB extension: its init connects to the database loading it, through
   the duckdb_connect the binding stored in tra_native_connect (tra_sql.udfs.native.loader), and
   leaves the connection in tra_native_connection for the binding to take. DuckDB's types are
   opaque pointers here, so no duckdb.h is needed. */
#include <stdbool.h>

typedef void *duckdb_extension_info;
typedef void *duckdb_database;
typedef void *duckdb_connection;
typedef int (*connect_function)(duckdb_database database, duckdb_connection *out);

struct duckdb_extension_access {
    void (*set_error)(duckdb_extension_info info, const char *error);
    duckdb_database *(*get_database)(duckdb_extension_info info);
    const void *(*get_api)(duckdb_extension_info info, const char *version);
};

#define EXPORT __attribute__((visibility("default")))

EXPORT connect_function tra_native_connect = 0;
EXPORT duckdb_connection tra_native_connection = 0;

/* A bind-data copy callback: bind data (a kernel's step parameters) is owned by the binding,
   so a copy is the same pointer. */
EXPORT void *tra_native_same(void *data) { return data; }

/* What DuckDB calls in place of malloc_trim while tra_sql.allocator keeps the heap (see
   keep_duckdb_heap): nothing is handed back, so freed pages are reused without faults. */
EXPORT int tra_native_keep_heap(unsigned long pad) { (void)pad; return 0; }

EXPORT bool tra_native_init_c_api(duckdb_extension_info info, struct duckdb_extension_access *access) {
    duckdb_database *database = access->get_database(info);
    if (!database || !tra_native_connect) {
        access->set_error(info, "tra_native: loaded without tra_sql's binding");
        return false;
    }
    if (tra_native_connect(*database, &tra_native_connection) != 0) {
        access->set_error(info, "tra_native: cannot connect to the database");
        return false;
    }
    return true;
}
