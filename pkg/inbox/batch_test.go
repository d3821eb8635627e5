package inbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
)

// A Batch applies each event under its own savepoint in one transaction: a
// failing or panicking side effect undoes its own event only, a duplicate
// runs nothing, and nothing is durable before Commit (a rolled-back batch
// leaves neither claims nor effects, so its events apply on redelivery).
func TestBatchAppliesEachEventUnderItsOwnSavepoint(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	ctx := context.Background()
	a1, a2, bad, boom, b1 := ev("A", 1), ev("A", 2), ev("B", 1), ev("C", 1), ev("D", 1)
	failing := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		if err := record(ctx, tx, e); err != nil {
			return err
		}
		return errors.New("side effect failed after writing")
	}
	panicking := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		_ = record(ctx, tx, e)
		panic("side effect panicked")
	}
	apply := func(b *inbox.Batch, e envelope.Envelope, fn inbox.Apply) (inbox.Outcome, error) {
		return b.Apply(ctx, e, func(ctx context.Context, tx pgx.Tx) error { return fn(ctx, tx, e) })
	}

	// A batch rolled back leaves nothing behind.
	rb, err := inbox.NewBatch(db.Pool, "c")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := apply(rb, a1, record); err != nil || out != inbox.Applied {
		t.Fatalf("a1 in the rolled-back batch: %v, %v", out, err)
	}
	rb.Rollback(ctx)
	if n := countEffects(t, db, a1.ID); n != 0 {
		t.Fatalf("a rolled-back batch left %d effects", n)
	}

	b, err := inbox.NewBatch(db.Pool, "c")
	if err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		name    string
		e       envelope.Envelope
		fn      inbox.Apply
		want    inbox.Outcome
		wantErr bool
	}{
		{"first event", a1, record, inbox.Applied, false},
		{"failing effect", bad, failing, 0, true},
		{"panicking effect", boom, panicking, 0, true},
		{"after the failures", a2, record, inbox.Applied, false},
		{"duplicate in the same batch", a1, record, inbox.Duplicate, false},
		{"last event", b1, record, inbox.Applied, false},
	} {
		out, err := apply(b, step.e, step.fn)
		if (err != nil) != step.wantErr || out != step.want {
			t.Fatalf("%s: %v, %v; want %v, error %v", step.name, out, err, step.want, step.wantErr)
		}
	}
	if err := b.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		e    envelope.Envelope
		want int
	}{{a1, 1}, {a2, 1}, {b1, 1}, {bad, 0}, {boom, 0}} {
		if n := countEffects(t, db, c.e.ID); n != c.want {
			t.Errorf("%s/%d: %d effects, want %d", c.e.AggregateID, c.e.Sequence, n, c.want)
		}
	}
	// The failed events were not claimed: delivered again, they apply.
	for _, e := range []envelope.Envelope{bad, boom} {
		if out, err := inbox.Process(ctx, db.Pool, "c", e, func(ctx context.Context, tx pgx.Tx) error { return record(ctx, tx, e) }); err != nil || out != inbox.Applied {
			t.Errorf("%s redelivered: %v, %v; want applied", e.AggregateID, out, err)
		}
	}
	if _, err := inbox.NewBatch(db.Pool, ""); err == nil {
		t.Error("NewBatch accepted an empty consumer name")
	}
}
