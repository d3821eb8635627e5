package migrations_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/capture"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/wire"
)

// poolWithPath connects with the given search_path (a startup parameter,
// as pkg/db sets it) and drops schema drop when the test ends.
func poolWithPath(t *testing.T, path, drop string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = path
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if drop != "" {
			_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{drop}.Sanitize()+" CASCADE")
		}
		pool.Close()
	})
	return pool
}

func testEvent(agg string, n int) envelope.Envelope {
	id, _ := uuid.NewV7()
	return envelope.Envelope{ID: id.String(), Type: "order.updated", OccurredAt: time.Now().UTC(), AggregateType: "order",
		AggregateID: agg, SchemaVersion: 1, Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, n))}
}

func states(t *testing.T, pool *pgxpool.Pool) (sent, pending, dead int) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE state = 'sent'),
		count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'dead') FROM outbox_events`).Scan(&sent, &pending, &dead); err != nil {
		t.Fatal(err)
	}
	return sent, pending, dead
}

// An install from before fifobox had its own schema (in the connection's
// default schema, public in production, here a test schema standing in for
// it) moves into fifobox's schema on the next Up, with its backlog: sent,
// pending and dead events keep their state, everything drains in order, the
// functions pinned to the old schema follow, the roles can reach the new
// one, and the old schema is left to the user (whose own outbox table then
// no longer collides with fifobox's).
func TestUpMovesAnEarlierInstallIntoItsSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	old := pgtest.NewEmpty(t) // "public": search_path is this schema alone
	if err := migrations.Up(ctx, old.Pool); err != nil {
		t.Fatal(err)
	}
	const aggregates, per = 20, 5
	for s := 1; s <= per; s++ {
		err := pgx.BeginFunc(ctx, old.Pool, func(tx pgx.Tx) error {
			evs := make([]envelope.Envelope, aggregates)
			for a := range evs {
				evs[a] = testEvent(fmt.Sprintf("m-%d", a), s)
			}
			return outbox.Enqueue(ctx, tx, evs...)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// seeds/004's producers, captured into the old install: their trigger
	// functions are pinned to the old schema by name.
	app := pgtest.NewEmpty(t)
	wireTest, err := os.ReadFile("../examples/seeds/transfers/wire_test.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := app.Pool.Exec(ctx, string(wireTest)); err != nil {
		t.Fatal(err)
	}
	prof, err := wire.Load("transfers")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := capture.Install(ctx, app.Pool, prof, capture.InstallConfig{Schema: old.Schema}); err != nil {
		t.Fatal(err)
	}
	// The demo's read model, with a row: the user's data, which stays.
	if err := readmodel.Setup(ctx, old.Pool); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Pool.Exec(ctx, `INSERT INTO orders_read_model (order_id, status, last_sequence, event_count) VALUES ('o-1', 'created', 1, 1)`); err != nil {
		t.Fatal(err)
	}
	upgraded := false
	rec := &outboxtest.Recorder{Fail: func(m outbox.Message) error {
		if m.GroupID == "m-1" && m.Sequence == 2 && !upgraded {
			return envelope.Permanent(errors.New("rejected"))
		}
		return nil
	}}
	cfg := outbox.DispatcherConfig{BatchSize: 15, MaxRun: 2, Workers: 1, PollInterval: 5 * time.Millisecond}
	d, err := outbox.NewDispatcher(old.Pool, rec, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if _, err := d.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	sent, pending, dead := states(t, old.Pool)
	if sent == 0 || pending == 0 || dead != 1 {
		t.Fatalf("before the upgrade: %d sent, %d pending, %d dead; want a mixed backlog", sent, pending, dead)
	}
	version, err := migrations.Version(ctx, old.Pool)
	if err != nil {
		t.Fatal(err)
	}

	// The new default path: fifobox's schema (not there yet), then the
	// user's, as pkg/db.SearchPath builds it.
	target := old.Schema + "_fifobox"
	pool := poolWithPath(t, fmt.Sprintf(`"%s", "$user", %s`, target, old.Schema), target)
	if err := migrations.Up(ctx, pool); err != nil {
		t.Fatalf("upgrade: %v", err)
	}
	upgraded = true
	if v, err := migrations.Version(ctx, pool); err != nil || v != version {
		t.Fatalf("version after the move: %d, %v; want %d", v, err, version)
	}
	var left []string
	rows, err := pool.Query(ctx, `SELECT relname::text FROM pg_class WHERE relnamespace = $1::regnamespace
		    AND relname NOT IN ('orders_read_model', 'orders_read_model_pkey')
		UNION ALL SELECT proname::text FROM pg_proc WHERE pronamespace = $1::regnamespace`, old.Schema)
	if err != nil {
		t.Fatal(err)
	}
	if left, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || len(left) != 0 {
		t.Fatalf("left in the old schema: %v, %v", left, err)
	}
	if s, p, dd := states(t, pool); s != sent || p != pending || dd != dead {
		t.Fatalf("after the move: %d sent, %d pending, %d dead; want %d, %d, %d", s, p, dd, sent, pending, dead)
	}
	// The demo's setup, run again on the new path (the redrive function's
	// migrate does), finds the demo's table where it is.
	if err := readmodel.Setup(ctx, pool); err != nil {
		t.Fatal(err)
	}
	var demo int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders_read_model`).Scan(&demo); err != nil || demo != 1 {
		t.Fatalf("the demo's read model: %d rows (%v), want its 1 row", demo, err)
	}
	var pins []string
	rows, err = pool.Query(ctx, `SELECT p.proname || ': ' || array_to_string(p.proconfig, ' ') FROM pg_proc p
		WHERE p.pronamespace = $1::regnamespace AND array_to_string(p.proconfig, ' ') LIKE '%search_path=%'
		  AND array_to_string(p.proconfig, ' ') NOT LIKE '%' || $1 || '%' AND array_to_string(p.proconfig, ' ') NOT LIKE '%search_path=pg_catalog, pg_temp%'`, target)
	if err != nil {
		t.Fatal(err)
	}
	if pins, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || len(pins) != 0 {
		t.Fatalf("functions not pinned to %s: %v, %v", target, pins, err)
	}
	var usage bool
	if err := pool.QueryRow(ctx, `SELECT has_schema_privilege('fifobox_producer', $1, 'USAGE')
		AND has_schema_privilege('fifobox_dispatcher', $1, 'USAGE')`, target).Scan(&usage); err != nil || !usage {
		t.Fatalf("roles' usage on %s: %v, %v", target, usage, err)
	}

	// The user's own outbox table (seeds/004's wire test) in "public" now
	// is theirs, beside fifobox's.
	if _, err := old.Pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS outbox (id uuid PRIMARY KEY, eventType text NOT NULL, payload jsonb NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Pool.Exec(ctx, `INSERT INTO outbox (id, eventType, payload) VALUES (gen_random_uuid(), 't', '{}')`); err != nil {
		t.Fatalf("the user's outbox in the old schema: %v", err)
	}

	// Producers and dispatchers on the new path drain everything, in order.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, testEvent("m-0", per+1))
	})
	if err != nil {
		t.Fatalf("enqueue after the move: %v", err)
	}
	// The capture trigger enqueues into the moved outbox.
	if _, err := app.Pool.Exec(ctx, string(wireTest)); err != nil {
		t.Fatalf("a captured insert after the move: %v", err)
	}
	const total = aggregates*per + 2
	if n, err := outbox.RequeueDead(ctx, pool, outbox.DeadSelection{AggregateType: "order"}); err != nil || n != 1 {
		t.Fatalf("requeue the dead event: %d, %v", n, err)
	}
	d, err = outbox.NewDispatcher(pool, rec, cfg)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		s, _, _ := states(t, pool)
		if s == total {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not drained: %d of %d sent", s, total)
		}
		if res, err := d.RunOnce(ctx); err != nil {
			t.Fatal(err)
		} else if res.Claimed == 0 {
			time.Sleep(10 * time.Millisecond)
		}
	}
	next := map[string]int64{}
	for _, a := range rec.Acks() {
		if a.Sequence != next[a.AggregateID]+1 {
			t.Fatalf("%s: event %d published after %d", a.AggregateID, a.Sequence, next[a.AggregateID])
		}
		next[a.AggregateID] = a.Sequence
	}
	if len(rec.Acks()) != total {
		t.Fatalf("%d events published, want %d", len(rec.Acks()), total)
	}
	// The capture's status trigger (on the moved outbox_heads) marks the
	// producers' row.
	var rowStates []string
	rows, err = app.Pool.Query(ctx, `SELECT state FROM outbox ORDER BY createdAt`)
	if err != nil {
		t.Fatal(err)
	}
	if rowStates, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || len(rowStates) != 2 || rowStates[1] != "SENT" {
		t.Fatalf("the producers' rows: %v, %v; want the captured one SENT", rowStates, err)
	}
}

// ObjectNames, what an upgrade moves, covers every object a fresh install
// creates (a migration that creates one with an unusual statement must be
// covered by hand), and no function names its schema in its body (a move
// would leave that reference behind).
func TestObjectNamesCoverAnInstall(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	names, err := migrations.ObjectNames()
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	for _, n := range names {
		known[n] = true
	}
	rows, err := db.Pool.Query(context.Background(), `
		SELECT relname::text FROM pg_class c
		WHERE relnamespace = current_schema()::regnamespace AND relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
		  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
		                  AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i'))
		  AND relname <> 'orders_read_model' -- pkg/readmodel's, created by pgtest
		UNION ALL
		SELECT proname::text FROM pg_proc WHERE pronamespace = current_schema()::regnamespace
		UNION ALL
		SELECT proname || ' names its schema' FROM pg_proc
		WHERE pronamespace = current_schema()::regnamespace AND prosrc LIKE '%' || current_schema() || '%'`)
	if err != nil {
		t.Fatal(err)
	}
	objects, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(objects) < 20 {
		t.Fatalf("only %d objects in a fresh install: %v", len(objects), objects)
	}
	for _, o := range objects {
		if !known[o] {
			t.Errorf("%s: not moved by an upgrade (migrations.ObjectNames)", o)
		}
	}
}

// A fresh Up into a schema that does not exist yet creates it, once, with
// several processes migrating at the same time.
func TestUpCreatesItsSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	user := pgtest.NewEmpty(t)
	target := user.Schema + "_fifobox"
	pool := poolWithPath(t, fmt.Sprintf(`"%s", "$user", %s`, target, user.Schema), target)
	errs := make(chan error, 3)
	for range 3 {
		go func() { errs <- migrations.Up(ctx, pool) }()
	}
	for range 3 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	var where string
	if err := pool.QueryRow(ctx, `SELECT relnamespace::regnamespace::text FROM pg_class WHERE oid = 'outbox'::regclass`).Scan(&where); err != nil || where != target {
		t.Fatalf("outbox in %q (%v), want %s", where, err, target)
	}
	var n int
	if err := user.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_class WHERE relnamespace = current_schema()::regnamespace`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d objects in the user's schema (%v), want none", n, err)
	}
}
