// Package migrations holds fifobox's versioned SQL schema, embedded in the
// binary and applied with goose. Lambdas, the CLI and tests all call Up.
package migrations

import (
	"context"
	"embed"
	"fmt"
	"hash/fnv"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed *.sql
var files embed.FS

// Up applies every pending migration to the database behind pool, in the
// schema first in the pool's search_path (pkg/db: FIFOBOX_SCHEMA, default
// fifobox), creating it if missing. An install from before fifobox had its
// own schema (in a schema later in the search_path, e.g. public) is moved
// there first, in one transaction. It is idempotent and safe to call from
// several processes at once: a session advisory lock, keyed by the target
// schema, serialises concurrent callers.
func Up(ctx context.Context, pool *pgxpool.Pool) error {
	return UpTo(ctx, pool, goose.MaxVersion)
}

// UpReport is Up, returning the files it applied, in order (none when the
// schema was current): what `fifobox migrate` reports.
func UpReport(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	return upTo(ctx, pool, goose.MaxVersion)
}

// UpTo is Up stopping at version (upgrade tests start from an older schema).
func UpTo(ctx context.Context, pool *pgxpool.Pool, version int64) error {
	_, err := upTo(ctx, pool, version)
	return err
}

func upTo(ctx context.Context, pool *pgxpool.Pool, version int64) ([]string, error) {
	schema, err := prepareSchema(ctx, pool)
	if err != nil {
		return nil, err
	}
	h := fnv.New64a()
	h.Write([]byte("fifobox-migrate:" + schema))
	locker, err := lock.NewPostgresSessionLocker(
		lock.WithLockID(int64(h.Sum64()>>1)),
		lock.WithLockTimeout(1, 300), // retry every second for up to 5 minutes
	)
	if err != nil {
		return nil, fmt.Errorf("migrate: locker: %w", err)
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, db, files,
		goose.WithSessionLocker(locker),
		goose.WithTableName("fifobox_schema_version"),
	)
	if err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	results, err := p.UpTo(ctx, version)
	if err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	applied := make([]string, 0, len(results))
	for _, r := range results {
		slog.InfoContext(ctx, "migration applied", "version", r.Source.Version, "file", r.Source.Path, "duration_ms", r.Duration.Milliseconds())
		applied = append(applied, r.Source.Path)
	}
	return applied, nil
}

// DownTo rolls the schema back to version (the Down sections, newest first).
// For tests of the migrations themselves and for an operator undoing an
// upgrade by hand; nothing in fifobox calls it.
func DownTo(ctx context.Context, pool *pgxpool.Pool, version int64) error {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, db, files, goose.WithTableName("fifobox_schema_version"))
	if err != nil {
		return fmt.Errorf("migrate down: %w", err)
	}
	if _, err := p.DownTo(ctx, version); err != nil {
		return fmt.Errorf("migrate down: %w", err)
	}
	return nil
}

// Version returns the schema version currently applied (0 if none).
func Version(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, db, files, goose.WithTableName("fifobox_schema_version"))
	if err != nil {
		return 0, fmt.Errorf("migrate: %w", err)
	}
	v, err := p.GetDBVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("migrate: read version: %w", err)
	}
	return v, nil
}
