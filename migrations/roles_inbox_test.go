package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
)

// settledBroker records what the engine settled, by record id.
type settledBroker struct {
	mu  sync.Mutex
	got map[string]string
}

func (b *settledBroker) put(r *inbox.Record, what string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.got == nil {
		b.got = map[string]string{}
	}
	b.got[r.ID] = what
	return nil
}

func (b *settledBroker) Ack(_ context.Context, r *inbox.Record) error { return b.put(r, "ack") }
func (b *settledBroker) Retry(_ context.Context, r *inbox.Record, _ inbox.Retry) error {
	return b.put(r, "retry")
}
func (b *settledBroker) DeadLetter(_ context.Context, r *inbox.Record, dl inbox.DeadLetter) error {
	return b.put(r, "dead:"+dl.Class)
}

// runEngine applies one batch for consumer as pool's user: o-1 applied,
// o-2 failing transiently (its group parked), o-3 rejected (its group held).
func runEngine(ctx context.Context, t *testing.T, pool *pgxpool.Pool, consumer string) map[string]string {
	t.Helper()
	e, err := inbox.NewEngine(pool, func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		switch e.AggregateID {
		case "o-2":
			return errors.New("busy")
		case "o-3":
			return envelope.Permanent(errors.New("rejected"))
		}
		return nil
	}, inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{Consumer: consumer, Logger: quiet}, MaxRetries: 3,
		RetryDelay: func(int) time.Duration { return time.Minute }})
	if err != nil {
		t.Fatal(err)
	}
	var recs []*inbox.Record
	for _, agg := range []string{"o-1", "o-2", "o-3"} {
		ev := orderEvent(agg, "order.created", `{}`)
		ev.Sequence = 1
		body, _ := ev.Encode()
		recs = append(recs, &inbox.Record{ID: agg, Body: body})
	}
	b := &settledBroker{}
	if err := e.Handle(ctx, b, recs); err != nil {
		t.Fatalf("%s: %v", consumer, err)
	}
	return b.got
}

// The consumer's tables (inbox, inbox_held, inbox_parked) are confined by
// row-level security (migration 00021): a login user mapped to one
// consumer does that consumer's whole job through the engine, and can
// neither read nor write another consumer's rows, nor widen its own scope;
// an unmapped member of fifobox_consumer still acts as any consumer (one
// shared consumer login keeps working); operations see every consumer; and
// no consumer user can touch the outbox.
func TestConsumerRoleIsConfinedToItsConsumers(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	seedForRoles(ctx, t, db)
	orders := loginAs(ctx, t, db, "fifobox_consumer")
	billing := loginAsNamed(ctx, t, db, "billing", "fifobox_consumer")
	shared := loginAsNamed(ctx, t, db, "shared", "fifobox_consumer")
	ops := loginAs(ctx, t, db, "fifobox_operations")
	userOf := func(p *pgxpool.Pool) string { return p.Config().ConnConfig.User }
	for user, consumer := range map[string]string{userOf(orders): "orders", userOf(billing): "billing"} {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO inbox_consumer_roles (role_name, consumer) VALUES ($1, $2)`, user, consumer); err != nil {
			t.Fatal(err)
		}
	}

	// Each does its consumer's job: claims, a park, a hold.
	want := map[string]string{"o-1": "ack", "o-2": "retry", "o-3": "dead:permanent"}
	for _, c := range []struct {
		pool     *pgxpool.Pool
		consumer string
	}{{orders, "orders"}, {billing, "billing"}, {shared, "reports"}} {
		got := runEngine(ctx, t, c.pool, c.consumer)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("%s as %s settled %v, want %v", c.consumer, userOf(c.pool), got, want)
		}
	}
	count := func(p *pgxpool.Pool, q string) int {
		t.Helper()
		var n int
		if err := p.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatalf("%s: %q: %v", userOf(p), q, err)
		}
		return n
	}
	const rows = `SELECT (SELECT count(*) FROM inbox) + (SELECT count(*) FROM inbox_held) + (SELECT count(*) FROM inbox_parked)`
	// Three consumers wrote 3 rows each (a claim, a park, a hold).
	if n := count(db.Pool, rows); n != 9 {
		t.Fatalf("owner sees %d rows, want 9", n)
	}
	if n := count(orders, rows); n != 3 {
		t.Errorf("the orders user sees %d rows, want its own 3", n)
	}
	if n := count(shared, rows); n != 9 {
		t.Errorf("the unmapped member of fifobox_consumer sees %d rows, want all 9", n)
	}
	if n := count(ops, rows); n != 9 {
		t.Errorf("operations see %d rows, want all 9", n)
	}

	// The orders user cannot touch billing's rows: writes are refused,
	// updates and deletes find nothing.
	for _, q := range []string{
		`INSERT INTO inbox (consumer, event_id, aggregate_type, aggregate_id, sequence) VALUES ('billing', gen_random_uuid(), 'order', 'x', 1)`,
		`INSERT INTO inbox_held (consumer, group_id, message_key, class) VALUES ('billing', 'o-9', 'k', 'held')`,
		`INSERT INTO inbox_parked (consumer, group_id, message_key, failures, retry, due_at, expires_at) VALUES ('billing', 'o-9', 'k', 0, 1, now(), now())`,
		`UPDATE inbox SET consumer = 'billing' WHERE consumer = 'orders'`,
		`INSERT INTO inbox_consumer_roles (role_name, consumer) VALUES (current_user, '*')`,
		`SELECT * FROM outbox`,
		`UPDATE outbox SET state = 'pending'`,
		`DELETE FROM outbox_wakeups`,
		`SELECT fifobox_enqueue('order', 'o-x', 'order.paid', '{}')`,
	} {
		_, err := orders.Exec(ctx, q)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("orders user ran %q: got %v, want insufficient_privilege or a row-level security violation (42501)", q, err)
		}
	}
	for _, q := range []string{
		`DELETE FROM inbox WHERE consumer = 'billing'`,
		`DELETE FROM inbox_held WHERE consumer = 'billing'`,
		`UPDATE inbox_parked SET failures = 0 WHERE consumer = 'billing'`,
	} {
		tag, err := orders.Exec(ctx, q)
		if err != nil || tag.RowsAffected() != 0 {
			t.Errorf("orders user ran %q: %d rows, %v; want none touched", q, tag.RowsAffected(), err)
		}
	}
	if n := count(db.Pool, `SELECT count(*) FROM inbox WHERE consumer = 'billing'`); n != 1 {
		t.Errorf("billing's inbox has %d rows after the orders user's attempts, want 1", n)
	}
}

// loginAsNamed is loginAs for a second user of the same role in one test.
func loginAsNamed(ctx context.Context, t *testing.T, db *pgtest.DB, name, role string) *pgxpool.Pool {
	t.Helper()
	if _, err := db.Pool.Exec(ctx, fmt.Sprintf(`CREATE ROLE %s NOLOGIN IN ROLE %s`, pgx.Identifier{db.Schema + "_" + name}.Sanitize(),
		pgx.Identifier{role}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(context.Background(), fmt.Sprintf(`DROP ROLE IF EXISTS %s`, pgx.Identifier{db.Schema + "_" + name}.Sanitize()))
	})
	return loginAs(ctx, t, db, db.Schema+"_"+name)
}
