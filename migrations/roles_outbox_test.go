package migrations_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// bodyRecorder is a publisher that keeps every acknowledged message, body
// included, in acknowledgement order.
type bodyRecorder struct {
	mu   sync.Mutex
	msgs []outbox.Message
}

func (r *bodyRecorder) Publish(_ context.Context, msgs []outbox.Message) []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, msgs...)
	return make([]error, len(msgs))
}

// drainAs publishes everything claimable as the dispatcher role and checks
// what was published: per aggregate, sequences 1, 2, 3... in order, each
// body the envelope of its row (same id, aggregate and sequence). It
// returns the published envelopes per aggregate id.
func drainAs(ctx context.Context, t *testing.T, db *pgtest.DB) map[string][]envelope.Envelope {
	t.Helper()
	pool := loginAs(ctx, t, db, "fifobox_dispatcher")
	rec := &bodyRecorder{}
	d, err := outbox.NewDispatcher(pool, rec, outbox.DispatcherConfig{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Drain(ctx); err != nil {
		t.Fatalf("drain: %v", err)
	}
	got := map[string][]envelope.Envelope{}
	for _, m := range rec.msgs {
		e, err := envelope.Decode(m.Body)
		if err != nil {
			t.Fatalf("published body of %s is no envelope: %v (%s)", m.EventID, err, m.Body)
		}
		if e.ID != m.EventID || e.AggregateID != m.GroupID || e.Sequence != m.Sequence {
			t.Fatalf("body says %s %s #%d, row says %s %s #%d", e.ID, e.AggregateID, e.Sequence, m.EventID, m.GroupID, m.Sequence)
		}
		if want := int64(len(got[m.GroupID]) + 1); m.Sequence != want {
			t.Fatalf("aggregate %s: published #%d after %d events, want #%d", m.GroupID, m.Sequence, len(got[m.GroupID]), want)
		}
		got[m.GroupID] = append(got[m.GroupID], e)
	}
	var pending int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_events WHERE state <> 'sent'`).Scan(&pending); err != nil || pending != 0 {
		t.Fatalf("%d events left unsent after the drain (%v)", pending, err)
	}
	return got
}

func refused(t *testing.T, err error, what string) {
	t.Helper()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Errorf("%s: got %v, want insufficient_privilege (42501)", what, err)
	}
}

// The attacks issue 27 reproduced as fifobox_producer, each now refused,
// and the forged-sequence scenario ending with every legitimate event
// published, in order, exactly once.
func TestProducerCannotForgeSequenceOrState(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	producer := loginAs(ctx, t, db, "fifobox_producer")
	enqueue := func(agg, typ string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
			return outbox.Enqueue(ctx, tx, orderEvent(agg, typ, `{"order_id":"`+agg+`"}`))
		}); err != nil {
			t.Fatalf("enqueue %s %s: %v", agg, typ, err)
		}
	}
	enqueue("o-1", "order.created")
	enqueue("o-1", "order.paid")
	enqueue("o-2", "order.created")

	for _, q := range []string{
		// Rewind another aggregate's counter, so its next event reuses #2.
		`UPDATE outbox_aggregates SET last_seq = 1 WHERE aggregate_id = 'o-1'`,
		`INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq) VALUES ('order', 'o-1', 1)
		 ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = 1`,
		`DELETE FROM outbox_aggregates`,
		`SELECT last_seq FROM outbox_aggregates`,
		// Pick a sequence: reuse one, or leave a gap nobody fills.
		`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body)
		 VALUES (gen_random_uuid(), 'order.paid', 'order', 'o-1', 2, now(), '{"payload":{}}')`,
		// A dead row (parks the aggregate; here with a body that is no JSON)
		// and a sent one (never published).
		`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, occurred_at, body, state)
		 VALUES (gen_random_uuid(), 'order.paid', 'order', 'o-1', now(), '\x7b', 'dead')`,
		`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, occurred_at, body, state)
		 VALUES (gen_random_uuid(), 'order.paid', 'order', 'o-1', now(), '{"payload":{}}', 'sent')`,
		`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, occurred_at, body, attempts, next_attempt_at)
		 VALUES (gen_random_uuid(), 'order.paid', 'order', 'o-1', now(), '{"payload":{}}', 99, 'infinity')`,
		// Wake-ups are the enqueue path's: a flood would only slow claims.
		`INSERT INTO outbox_wakeups (aggregate_type, aggregate_id) VALUES ('order', 'o-1')`,
		`SELECT * FROM outbox_prune(0, 10, now())`,
		`SELECT outbox_requeue_dead('{}', '', NULL, NULL)`,
	} {
		_, err := producer.Exec(ctx, q)
		refused(t, err, "producer "+q)
	}
	// Not even the owner can give a sequence twice.
	_, err := db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body)
		VALUES (gen_random_uuid(), 'order.paid', 'order', 'o-1', 2, now(), '{}')`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" || pgErr.ConstraintName != "outbox_aggregate_seq_key" {
		t.Errorf("owner reused o-1 #2: got %v, want a unique violation of outbox_aggregate_seq_key", err)
	}

	enqueue("o-1", "order.shipped")
	enqueue("o-2", "order.paid")

	// Temporary tables named like fifobox's, in the producer's own session,
	// do not stand in for them inside the enqueue path (its search_path ends
	// with pg_temp): a counter of its choosing is not used.
	conn, err := producer.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`CREATE TEMP TABLE outbox_aggregates (aggregate_type text, aggregate_id text, last_seq bigint, PRIMARY KEY (aggregate_type, aggregate_id))`,
		`INSERT INTO pg_temp.outbox_aggregates VALUES ('order', 'o-1', 100)`,
		`CREATE TEMP TABLE outbox (event_id uuid, event_type text, aggregate_type text, aggregate_id text, aggregate_seq bigint,
		 tenant_id text, traceparent text, occurred_at timestamptz, body bytea)`,
		`CREATE TEMP TABLE outbox_wakeups (aggregate_type text, aggregate_id text)`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, orderEvent("o-1", "order.refunded", `{"order_id":"o-1"}`))
	}); err != nil {
		t.Fatalf("enqueue beside temporary tables: %v", err)
	}
	var temp int
	if err := conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM pg_temp.outbox) + (SELECT count(*) FROM pg_temp.outbox_wakeups)`).Scan(&temp); err != nil || temp != 0 {
		t.Fatalf("%d rows went to the temporary tables (%v)", temp, err)
	}
	conn.Release()

	got := drainAs(ctx, t, db)
	if len(got["o-1"]) != 4 || len(got["o-2"]) != 2 || got["o-1"][3].Type != "order.refunded" {
		t.Fatalf("published o-1 %d events, o-2 %d; want 4 (the last order.refunded) and 2", len(got["o-1"]), len(got["o-2"]))
	}
}

// A producer's hand-written INSERT INTO outbox (the body an envelope
// without a sequence) is validated like Enqueue, numbered in commit order
// among Enqueue's events and published like them.
func TestDirectInsertIsPublishedInOrder(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	producer := loginAs(ctx, t, db, "fifobox_producer")
	direct := func(agg, typ string) error {
		e := orderEvent(agg, typ, `{ "order_id" : "`+agg+`" }`)
		return pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, occurred_at, body)
				VALUES ($1::uuid, $2, $3, $4, $5, convert_to(json_build_object('id', $1::uuid::text, 'type', $2::text,
				    'occurred_at', to_char($5::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
				    'aggregate_type', $3::text, 'aggregate_id', $4::text, 'payload', $6::json)::text, 'UTF8'))`,
				e.ID, e.Type, e.AggregateType, e.AggregateID, e.OccurredAt, string(e.Payload))
			return err
		})
	}
	for i, step := range []struct{ agg, typ string }{
		{"o-1", "order.created"}, {"o-1", "order.paid"}, {"o-2", "order.created"}, {"o-1", "order.shipped"},
	} {
		if i%2 == 0 {
			if err := direct(step.agg, step.typ); err != nil {
				t.Fatalf("direct insert %d: %v", i, err)
			}
		} else if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
			return outbox.Enqueue(ctx, tx, orderEvent(step.agg, step.typ, `{"order_id":"`+step.agg+`"}`))
		}); err != nil {
			t.Fatalf("enqueue %d: %v", i, err)
		}
	}
	// Only the body's own columns may be given, and the body must be a
	// valid envelope that agrees with them.
	for _, tc := range []struct {
		name, body, column, code string
	}{
		{"body is no JSON", `{`, "body", "22023"},
		{"body is an array", `[]`, "body", "22023"},
		{"no payload", `{"aggregate_id":"o-3"}`, "payload", "22004"},
		{"aggregate id with a space", `{"payload":{},"aggregate_id":"o 3"}`, "aggregate_id", "22023"},
		{"unknown member", `{"payload":{},"state":"sent"}`, "state", "22023"},
		{"v is not 1", `{"payload":{},"v":2}`, "v", "22023"},
		{"body and column differ", `{"payload":{},"aggregate_id":"o-2"}`, "aggregate_id", "22023"},
	} {
		_, err := producer.Exec(ctx, `INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, occurred_at, body)
			VALUES (gen_random_uuid(), 'order.paid', 'order', 'o-3', now(), convert_to($1, 'UTF8'))`, tc.body)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != tc.code || pgErr.ColumnName != tc.column {
			t.Errorf("%s: got %v (column %q), want SQLSTATE %s naming %s", tc.name, err, columnOf(err), tc.code, tc.column)
		}
	}

	got := drainAs(ctx, t, db)
	if len(got["o-1"]) != 3 || len(got["o-2"]) != 1 {
		t.Fatalf("published o-1 %d events, o-2 %d; want 3 and 1", len(got["o-1"]), len(got["o-2"]))
	}
	for i, typ := range []string{"order.created", "order.paid", "order.shipped"} {
		if e := got["o-1"][i]; e.Type != typ || string(e.Payload) != `{"order_id":"o-1"}` {
			t.Errorf("o-1 #%d: %s %s, want %s with the payload compacted", i+1, e.Type, e.Payload, typ)
		}
	}
}

func columnOf(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.ColumnName
	}
	return ""
}

// A bulk load written straight into the outbox (INSERT ... SELECT of 10,000
// rows, the shape that once published 0 of 170,000) is published in full,
// each aggregate in order.
func TestBulkInsertIsPublished(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	producer := loginAs(ctx, t, db, "fifobox_producer")
	const n, aggregates = 10000, 100
	start := time.Now()
	if _, err := producer.Exec(ctx, `
		INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, occurred_at, body)
		SELECT gen_random_uuid(), 'order.imported', 'order', 'bulk-' || (g % $2), now(),
		       convert_to(json_build_object('payload', json_build_object('n', g))::text, 'UTF8')
		FROM generate_series(1, $1) g ORDER BY g`, n, aggregates); err != nil {
		t.Fatalf("bulk insert: %v", err)
	}
	t.Logf("bulk insert of %d rows: %v", n, time.Since(start).Round(time.Millisecond))
	got := drainAs(ctx, t, db)
	total := 0
	for agg, evs := range got {
		total += len(evs)
		var prev float64
		for _, e := range evs { // in the order the INSERT ... SELECT wrote them
			var p struct{ N float64 }
			if err := envelopeJSON(e, &p); err != nil || p.N <= prev {
				t.Fatalf("%s: payload n %v after %v (%v)", agg, p.N, prev, err)
			}
			prev = p.N
		}
	}
	if len(got) != aggregates || total != n {
		t.Fatalf("published %d events over %d aggregates, want %d over %d", total, len(got), n, aggregates)
	}
}

// What the other roles could forge or lose before 00038, each refused now.
func TestRolesCannotRewriteOrLoseEvents(t *testing.T) {
	t.Parallel()
	for role, qs := range map[string][]string{
		"fifobox_dispatcher": {
			`UPDATE outbox SET body = '\x7b7d'`,
			`UPDATE outbox SET aggregate_seq = aggregate_seq + 100`,
			`UPDATE outbox SET event_id = gen_random_uuid()`,
			`UPDATE outbox SET aggregate_id = 'other'`,
			`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, occurred_at, body) VALUES (gen_random_uuid(), 't', 'order', 'x', now(), '{"payload":{}}')`,
			`SELECT * FROM outbox_prune(0, 10, now())`,
			`SELECT outbox_discard_dead('{}', '', NULL, NULL, 'x')`,
			`UPDATE outbox_aggregates SET last_seq = 0`,
		},
		"fifobox_operations": {
			`UPDATE outbox SET body = '\x7b7d'`,
			`UPDATE outbox SET state = 'sent' WHERE state = 'pending'`,
			`UPDATE outbox SET state = 'discarded' WHERE state = 'pending'`,
			`DELETE FROM outbox WHERE state = 'pending'`,
			`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, occurred_at, body) VALUES (gen_random_uuid(), 't', 'order', 'x', now(), '{"payload":{}}')`,
			`INSERT INTO outbox_wakeups (aggregate_type, aggregate_id) VALUES ('order', 'x')`,
		},
		"fifobox_consumer": {
			`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, occurred_at, body) VALUES (gen_random_uuid(), 't', 'order', 'x', now(), '{"payload":{}}')`,
			`SELECT * FROM outbox_prune(0, 10, now())`,
			`SELECT outbox_requeue_dead('{}', '', NULL, NULL)`,
		},
	} {
		t.Run(role, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			ctx := context.Background()
			seedForRoles(ctx, t, db)
			pool := loginAs(ctx, t, db, role)
			for _, q := range qs {
				_, err := pool.Exec(ctx, q)
				refused(t, err, role+" "+q)
			}
			if role == "fifobox_operations" {
				// Its own prune deletes sent events only: the pending ones stay.
				var n int64
				if err := pool.QueryRow(ctx, `SELECT deleted FROM outbox_prune(0, 1000, 'infinity')`).Scan(&n); err != nil || n != 0 {
					t.Fatalf("prune with nothing sent: %d rows, %v", n, err)
				}
			}
			var unsent int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state IN ('pending', 'dead')`).Scan(&unsent); err != nil || unsent != 4 {
				t.Fatalf("%d unsent events after the attempts, want the 4 seeded (%v)", unsent, err)
			}
		})
	}
}

func envelopeJSON(e envelope.Envelope, v any) error {
	if err := json.Unmarshal(e.Payload, v); err != nil {
		return fmt.Errorf("payload %s: %w", e.Payload, err)
	}
	return nil
}

// The rolling upgrade: producers take the new library first (Enqueue calls
// fifobox_enqueue_events, which the producer role could already run before
// 00038), then the migration runs under them; the events of both sides of
// it are published in order. (The previous library's Enqueue, which wrote
// outbox_aggregates itself, is refused by 00038 under fifobox_producer.)
func TestEnqueueAcrossTheGuardMigration(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	if err := migrations.UpTo(ctx, db.Pool, 21); err != nil {
		t.Fatal(err)
	}
	producer := loginAs(ctx, t, db, "fifobox_producer")
	enqueue := func(typ string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
			return outbox.Enqueue(ctx, tx, orderEvent("o-1", typ, `{"order_id":"o-1"}`))
		}); err != nil {
			t.Fatalf("enqueue %s: %v", typ, err)
		}
	}
	enqueue("order.created")
	if err := migrations.Up(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	enqueue("order.paid")
	if got := drainAs(ctx, t, db); len(got["o-1"]) != 2 || got["o-1"][1].Type != "order.paid" {
		t.Fatalf("published %v, want o-1's two events in order", got)
	}
}
