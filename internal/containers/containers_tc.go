//go:build testcontainers

package containers

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/wait"
)

func init() { start = startContainer }

func startContainer(ctx context.Context, kind string) (string, error) {
	var req testcontainers.ContainerRequest
	switch kind {
	case Postgres:
		req = testcontainers.ContainerRequest{
			Image:        "postgres:15",
			Env:          map[string]string{"POSTGRES_HOST_AUTH_METHOD": "trust", "POSTGRES_DB": "test"},
			ExposedPorts: []string{"5432/tcp"},
			// The server restarts once after initdb: wait for the second "ready".
			WaitingFor: wait.ForLog("database system is ready to accept connections").WithOccurrence(2).WithStartupTimeout(2 * time.Minute),
		}
	case Emulator:
		req = testcontainers.ContainerRequest{
			Image:        "floci/floci:1.5.11",
			ExposedPorts: []string{"4566/tcp"},
			WaitingFor:   wait.ForListeningPort("4566/tcp").WithStartupTimeout(2 * time.Minute),
		}
		if tok := os.Getenv("LOCALSTACK_AUTH_TOKEN"); tok != "" {
			req.Image = "localstack/localstack:4.9"
			req.Env = map[string]string{"LOCALSTACK_AUTH_TOKEN": tok, "SERVICES": "sns,sqs"}
			req.WaitingFor = wait.ForHTTP("/_localstack/health").WithPort("4566/tcp").WithStartupTimeout(3 * time.Minute)
		}
	default:
		return "", fmt.Errorf("containers: unknown kind %q", kind)
	}
	c, err := testcontainers.GenericContainer(ctx, testcontainers.GenericContainerRequest{ContainerRequest: req, Started: true})
	if err != nil {
		return "", fmt.Errorf("start %s container (%s): %w", kind, req.Image, err)
	}
	host, err := c.Host(ctx)
	if err != nil {
		return "", fmt.Errorf("%s container host: %w", kind, err)
	}
	if kind == Postgres {
		p, err := c.MappedPort(ctx, "5432/tcp")
		if err != nil {
			return "", fmt.Errorf("postgres container port: %w", err)
		}
		return fmt.Sprintf("postgres://postgres@%s:%s/test?sslmode=disable", host, p.Port()), nil
	}
	p, err := c.MappedPort(ctx, "4566/tcp")
	if err != nil {
		return "", fmt.Errorf("emulator container port: %w", err)
	}
	return fmt.Sprintf("http://%s:%s", host, p.Port()), nil
}
