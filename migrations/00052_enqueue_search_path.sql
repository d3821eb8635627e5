-- +goose Up

-- Producers in another schema call fifobox's enqueue functions by their
-- qualified name (SELECT fifobox.fifobox_enqueue(...)) with their own
-- search_path, which may hold a table of theirs named outbox (seeds/004's
-- wire test) and not fifobox's helpers: every name inside these functions
-- must resolve in fifobox's schema, whatever the caller's path. A function's
-- own search_path applies to everything it calls, so the entry points are
-- enough: one setting per call, no change for callers whose path already
-- starts with fifobox's schema. Generic over the entry points (whatever
-- their signatures are now), so a migration that redefines one must run
-- before this one or set the same.
-- +goose StatementBegin
DO $path$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace
               AND p.proname IN ('fifobox_enqueue', 'fifobox_enqueue_batch', 'fifobox_enqueue_events') LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_catalog', f, current_schema());
    END LOOP;
END
$path$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DO $path$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace
               AND p.proname IN ('fifobox_enqueue', 'fifobox_enqueue_batch', 'fifobox_enqueue_events') LOOP
        EXECUTE format('ALTER FUNCTION %s RESET search_path', f);
    END LOOP;
END
$path$;
-- +goose StatementEnd
