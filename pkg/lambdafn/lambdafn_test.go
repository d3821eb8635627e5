package lambdafn_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/lambdafn"
)

// Lambda gives a function's init 10 s. A database that accepts the
// connection and never answers (a proxy that hangs, a security group that
// black-holes) must fail the init with an error well inside that, not
// outlast it.
func TestConnectFinishesInsideLambdasInitLimit(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			held = append(held, c) // accept, never answer
		}
	}()
	t.Setenv("FIFOBOX_DATABASE_URL", "postgres://fifobox@"+l.Addr().String()+"/fifobox") // sslmode prefer: two attempts
	t.Setenv("AWS_REGION", "us-east-1")
	t.Setenv("AWS_ACCESS_KEY_ID", "test")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "test")
	start := time.Now()
	_, _, err = lambdafn.Connect(context.Background())
	elapsed := time.Since(start)
	if err == nil || !strings.Contains(err.Error(), "connect to database") {
		t.Fatalf("Connect = %v, want a connection error", err)
	}
	if elapsed > 9*time.Second {
		t.Fatalf("Connect took %s: Lambda's init limit is 10 s", elapsed.Round(time.Millisecond))
	}
	t.Logf("init failed after %s: %v", elapsed.Round(time.Millisecond), err)
}
