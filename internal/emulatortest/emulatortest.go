// Package emulatortest connects integration tests to an SNS/SQS endpoint:
// FIFOBOX_TEST_AWS_ENDPOINT (or AWS_ENDPOINT_URL) if set, such as LocalStack
// or Floci; else, with FIFOBOX_TESTCONTAINERS=1 and -tags testcontainers, a
// Floci (or LocalStack) container; otherwise the Docker-free fauxqs emulator
// on 127.0.0.1:4566 (FIFOBOX_EMULATOR_PORT), started through
// localstack/emulator.sh if it is not running. An emulator started here
// stops by itself when the `go test` command that needed it ends (see
// owners.go); one that was already running is left alone. Each test
// provisions its own topology under a unique name prefix, so tests run in
// parallel on one emulator. FIFOBOX_SKIP_EMULATOR=1 skips these tests.
package emulatortest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials"
	snssvc "github.com/aws/aws-sdk-go-v2/service/sns"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/fifobox/fifobox/internal/containers"
	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

var (
	installOnce sync.Once
	installErr  error

	once     sync.Once
	endpoint string
	startErr error
)

// Endpoint returns the AWS endpoint for tests, starting the local emulator if needed.
func Endpoint(tb testing.TB) string {
	tb.Helper()
	if os.Getenv("FIFOBOX_SKIP_EMULATOR") == "1" {
		tb.Skip("FIFOBOX_SKIP_EMULATOR=1")
	}
	once.Do(func() {
		for _, v := range []string{"FIFOBOX_TEST_AWS_ENDPOINT", "AWS_ENDPOINT_URL"} {
			if e := os.Getenv(v); e != "" {
				endpoint = e
				fmt.Fprintf(os.Stderr, "emulatortest: using %s=%s\n", v, e)
				return
			}
		}
		if containers.Enabled() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			endpoint, startErr = containers.Start(ctx, containers.Emulator)
			if startErr == nil {
				fmt.Fprintf(os.Stderr, "emulatortest: using an emulator container (testcontainers) at %s\n", endpoint)
			}
			return
		}
		port := 4566
		if p, err := strconv.Atoi(os.Getenv("FIFOBOX_EMULATOR_PORT")); err == nil && p > 0 {
			port = p
		}
		endpoint = fmt.Sprintf("http://127.0.0.1:%d", port)
		startErr = withLock(port, func() error { return startOrJoin(port, endpoint) })
	})
	if startErr != nil {
		tb.Fatalf("emulatortest: %v (set FIFOBOX_SKIP_EMULATOR=1 to skip)", startErr)
	}
	return endpoint
}

// startOrJoin uses the emulator on port, co-owning it if tests started it,
// or starts one owned by this `go test` command. Called under the owners lock.
func startOrJoin(port int, endpoint string) error {
	if healthy(endpoint) {
		if _, err := os.Stat(ownersDir(port)); err == nil {
			fmt.Fprintf(os.Stderr, "emulatortest: using the emulator tests started at %s\n", endpoint)
			return register(port)
		}
		fmt.Fprintf(os.Stderr, "emulatortest: using the emulator already running at %s\n", endpoint)
		return nil
	}
	_ = os.RemoveAll(ownersDir(port)) // left by an emulator that did not exit cleanly
	if err := register(port); err != nil {
		return fmt.Errorf("register as the emulator's owner: %w", err)
	}
	cmd := exec.Command(filepath.Join(RepoRoot(), "localstack", "emulator.sh"), "start")
	cmd.Env = append(os.Environ(), fmt.Sprintf("FIFOBOX_EMULATOR_PORT=%d", port), "FIFOBOX_EMULATOR_OWNERS="+ownersDir(port))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		_ = os.RemoveAll(ownersDir(port))
		return fmt.Errorf("start emulator: %w", err)
	}
	fmt.Fprintf(os.Stderr, "emulatortest: started fauxqs at %s; it stops when this go test command ends\n", endpoint)
	return nil
}

// Config returns SDK configuration for the endpoint with dummy credentials.
func Config(tb testing.TB, endpoint string) aws.Config {
	tb.Helper()
	cfg, err := config.LoadDefaultConfig(context.Background(),
		config.WithRegion("us-east-1"),
		config.WithCredentialsProvider(credentials.NewStaticCredentialsProvider("test", "test", "")),
		config.WithBaseEndpoint(endpoint),
	)
	if err != nil {
		tb.Fatalf("emulatortest: config: %v", err)
	}
	return cfg
}

// Env is a test's own provisioned topology on the emulator.
type Env struct {
	Endpoint string
	SNS      *snssvc.Client
	SQS      *sqs.Client
	sns.Resources
}

// New provisions topology t under a unique prefix. visibility overrides the
// queues' visibility timeout (seconds; 0 keeps the topology's).
func New(tb testing.TB, t topology.Topology, visibility int) *Env {
	tb.Helper()
	return NewAt(tb, Endpoint(tb), t, visibility)
}

// NewAt is New against a given endpoint (e.g. a dedicated Process).
func NewAt(tb testing.TB, ep string, t topology.Topology, visibility int) *Env {
	tb.Helper()
	cfg := Config(tb, ep)
	e := &Env{Endpoint: ep, SNS: awsclient.SNS(cfg), SQS: awsclient.SQS(cfg)}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := sns.Provision(ctx, e.SNS, e.SQS, t, sns.ProvisionOptions{Prefix: "t" + hex.EncodeToString(b) + "-", VisibilityTimeoutSeconds: visibility})
	if err != nil {
		tb.Fatalf("emulatortest: provision: %v", err)
	}
	e.Resources = res
	// Delete what the test made: messages left in queues would pile up in
	// the shared emulator's memory and slow every later test down.
	tb.Cleanup(func() {
		if !accepting(ep) {
			// A dedicated emulator the test stopped: its state went with
			// it, and each delete would only retry against a closed port
			// (seconds each).
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, q := range res.Queues {
			for _, u := range []string{q.URL, q.DLQURL} {
				_, _ = e.SQS.DeleteQueue(ctx, &sqs.DeleteQueueInput{QueueUrl: aws.String(u)})
			}
		}
		_, _ = e.SNS.DeleteTopic(ctx, &snssvc.DeleteTopicInput{TopicArn: aws.String(res.TopicARN)})
	})
	return e
}

// accepting says whether anything accepts connections at endpoint's address.
func accepting(endpoint string) bool {
	u, err := url.Parse(endpoint)
	if err != nil {
		return true
	}
	c, err := net.DialTimeout("tcp", u.Host, 2*time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func healthy(endpoint string) bool {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(endpoint + "/health")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == 200
}

// RepoRoot finds the directory holding go.mod, from the test's directory up.
func RepoRoot() string {
	dir, _ := os.Getwd()
	for d := dir; d != "/"; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			if _, err := os.Stat(filepath.Join(d, "localstack")); err == nil {
				return d
			}
		}
	}
	return dir
}

// Process is a dedicated emulator the test can stop and restart (outage
// tests). Its state persists in a temporary directory across restarts.
type Process struct {
	tb      testing.TB
	Port    int
	URL     string
	dataDir string
	cmd     *exec.Cmd
}

// StartProcess starts a dedicated fauxqs on a free port (state persisted
// in a temporary directory across Stop/Start).
func StartProcess(tb testing.TB) *Process {
	tb.Helper()
	if os.Getenv("FIFOBOX_SKIP_EMULATOR") == "1" {
		tb.Skip("FIFOBOX_SKIP_EMULATOR=1")
	}
	installOnce.Do(func() {
		// The shared emulator may belong to another checkout: install ours.
		cmd := exec.Command(filepath.Join(RepoRoot(), "localstack", "emulator.sh"), "install")
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		installErr = cmd.Run()
	})
	if installErr != nil {
		tb.Fatalf("emulatortest: install emulator: %v", installErr)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	p := &Process{tb: tb, Port: port, URL: fmt.Sprintf("http://127.0.0.1:%d", port), dataDir: tb.TempDir()}
	p.Start()
	tb.Cleanup(p.Stop)
	return p
}

// Start (re)starts the process and waits until it is healthy.
func (p *Process) Start() {
	p.tb.Helper()
	root := RepoRoot()
	p.cmd = exec.Command(filepath.Join(root, "localstack", "node_modules", ".bin", "node"), filepath.Join(root, "localstack", "launcher.mjs"))
	// Owned by this test process: if it dies before its cleanup runs (a
	// panic, a timeout), the emulator exits by itself.
	owners := filepath.Join(p.dataDir, "owners")
	if err := os.MkdirAll(owners, 0o755); err != nil {
		p.tb.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(owners, strconv.Itoa(os.Getpid())), nil, 0o644); err != nil {
		p.tb.Fatal(err)
	}
	p.cmd.Env = append(os.Environ(), fmt.Sprintf("FIFOBOX_EMULATOR_PORT=%d", p.Port), "FIFOBOX_EMULATOR_DATA_DIR="+filepath.Join(p.dataDir, "state"),
		"FIFOBOX_EMULATOR_OWNERS="+owners)
	if err := p.cmd.Start(); err != nil {
		p.tb.Fatalf("emulatortest: start dedicated emulator: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !healthy(p.URL) {
		if time.Now().After(deadline) {
			p.tb.Fatalf("emulatortest: dedicated emulator on %d not healthy", p.Port)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Stop kills the process (an outage, as abrupt as a crash).
func (p *Process) Stop() {
	if p.cmd != nil && p.cmd.Process != nil {
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
		p.cmd = nil
	}
}
