-- +goose Up

-- Helpers for pkg/capture: a system's producers keep writing their own
-- outbox table, and a trigger that capture.Install generates from the
-- profile's source section enqueues each row through
-- fifobox_enqueue_events. These convert the values such tables hold.

-- fifobox_ulid_to_uuid: a ULID (26 characters of Crockford base32, either
-- case) as the UUID of the same 128 bits, as pkg/wire's IDFormat.Stored
-- does. Anything else is an error naming the field (SQLSTATE 22023, column
-- 'id'), so a producer's bad id fails its own insert, loudly.
-- +goose StatementBegin
CREATE FUNCTION fifobox_ulid_to_uuid(u text) RETURNS uuid
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $f$
DECLARE
    b varbit := B'';
BEGIN
    IF u !~* '^[0-7][0-9A-HJKMNP-TV-Z]{25}$' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', COLUMN = 'id',
            MESSAGE = format('enqueue: id %L is not a ULID (26 characters of Crockford base32)', u);
    END IF;
    FOR i IN 1..26 LOOP
        b := b || (strpos('0123456789ABCDEFGHJKMNPQRSTVWXYZ', upper(substr(u, i, 1))) - 1)::bit(5);
    END LOOP;
    b := substring(b FROM 3); -- the first character carries 3 bits; the top 2 are 0
    RETURN (lpad(to_hex(substring(b FROM 1 FOR 32)::bit(32)::int), 8, '0')
         || lpad(to_hex(substring(b FROM 33 FOR 32)::bit(32)::int), 8, '0')
         || lpad(to_hex(substring(b FROM 65 FOR 32)::bit(32)::int), 8, '0')
         || lpad(to_hex(substring(b FROM 97 FOR 32)::bit(32)::int), 8, '0'))::uuid;
END
$f$;
-- +goose StatementEnd

-- fifobox_uuid_to_ulid: the reverse, upper case (ulid.ULID.String).
-- +goose StatementBegin
CREATE FUNCTION fifobox_uuid_to_ulid(id uuid) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $f$
DECLARE
    b varbit := B'00' || ('x' || replace(id::text, '-', ''))::bit(128);
    out text := '';
BEGIN
    FOR i IN 0..25 LOOP
        out := out || substr('0123456789ABCDEFGHJKMNPQRSTVWXYZ', substring(b FROM i * 5 + 1 FOR 5)::bit(5)::int + 1, 1);
    END LOOP;
    RETURN out;
END
$f$;
-- +goose StatementEnd

-- fifobox_rfc3339: a timestamp as RFC 3339 in UTC, as Go's time.RFC3339Nano
-- writes it (fractional seconds without trailing zeros), whatever the
-- session's TimeZone: what a source payload template puts where the row
-- has a timestamp column.
-- +goose StatementBegin
CREATE FUNCTION fifobox_rfc3339(t timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $f$
SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
    || coalesce('.' || nullif(rtrim(lpad((extract(microseconds FROM t)::bigint % 1000000)::text, 6, '0'), '0'), ''), '')
    || 'Z'
$f$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION fifobox_rfc3339(timestamptz);
DROP FUNCTION fifobox_uuid_to_ulid(uuid);
DROP FUNCTION fifobox_ulid_to_uuid(text);
