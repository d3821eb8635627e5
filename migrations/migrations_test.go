package migrations_test

import (
	"context"
	"sync"
	"testing"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/migrations"
)

func TestUpIsIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = migrations.Up(ctx, db.Pool) }()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("concurrent Up %d: %v", i, err)
		}
	}
	if err := migrations.Up(ctx, db.Pool); err != nil {
		t.Fatalf("second Up: %v", err)
	}
	v, err := migrations.Version(ctx, db.Pool)
	if err != nil || v < 1 {
		t.Fatalf("Version = %d, %v; want >= 1", v, err)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&n); err != nil {
		t.Fatalf("outbox table missing in schema %s: %v", db.Schema, err)
	}
}

// Every Down section runs: from the newest version down to the first
// migration's, and up again.
func TestDownAndUpAgain(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	latest, err := migrations.Version(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if err := migrations.DownTo(ctx, db.Pool, 1); err != nil {
		t.Fatalf("down from %d to 1: %v", latest, err)
	}
	if v, _ := migrations.Version(ctx, db.Pool); v != 1 {
		t.Fatalf("version %d after down, want 1", v)
	}
	if err := migrations.Up(ctx, db.Pool); err != nil {
		t.Fatalf("up again: %v", err)
	}
	if v, _ := migrations.Version(ctx, db.Pool); v != latest {
		t.Fatalf("version %d after up, want %d", v, latest)
	}
}
